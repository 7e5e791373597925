// The threads a listener runs accepted connections' handshakes on, one each, so that a slow or
// silent client holds up only its own handshake. Finished threads are joined as new ones start;
// the rest when this goes, so nothing a listener started outlives it. Used by one thread (the
// listener's accept loop), then destroyed after it stopped.
#ifndef TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_
#define TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_

#include <atomic>
#include <functional>
#include <list>
#include <thread>

namespace tf_rdma {

class HandshakeThreads {
 public:
  HandshakeThreads() = default;
  HandshakeThreads(const HandshakeThreads&) = delete;
  HandshakeThreads& operator=(const HandshakeThreads&) = delete;
  ~HandshakeThreads() {
    for (auto& worker : workers_) worker.thread.join();
  }

  void Start(std::function<void()> handshake) {
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->finished) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    Worker& worker = workers_.emplace_back();
    worker.thread = std::thread([&worker, handshake = std::move(handshake)] {
      handshake();
      worker.finished = true;
    });
  }

 private:
  struct Worker {
    std::thread thread;
    std::atomic<bool> finished{false};
  };
  std::list<Worker> workers_;  // list: a running thread holds a reference to its element
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_
