// The threads a listener runs accepted connections' handshakes on, one each, so that a slow or
// silent client holds up only its own handshake. At most TransportLimits::max_concurrent_handshakes
// run at once: each holds a thread and a descriptor until the client finishes or the connect
// timeout passes, and a flood of clients must not exhaust either. Finished threads are joined as
// new ones start; the rest when this goes, so nothing a listener started outlives it. Used by one
// thread (the listener's accept loop), then destroyed after it stopped.
#ifndef TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_
#define TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_

#include <atomic>
#include <functional>
#include <list>
#include <system_error>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {

class HandshakeThreads {
 public:
  explicit HandshakeThreads(size_t max_concurrent) : max_concurrent_(max_concurrent) {}
  HandshakeThreads(const HandshakeThreads&) = delete;
  HandshakeThreads& operator=(const HandshakeThreads&) = delete;
  ~HandshakeThreads() {
    for (auto& worker : workers_) worker.thread.join();
  }

  // Runs `handshake` on a thread of its own. Fails with kResourceExhausted, without running it,
  // when the limit of concurrent handshakes is reached or no thread can be started (pids limit,
  // address space); the caller then refuses that client and keeps serving.
  absl::Status Start(std::function<void()> handshake) {
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->finished) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    if (workers_.size() >= max_concurrent_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many concurrent handshakes: ", workers_.size(),
          " clients are handshaking, the limit TF_RDMA_MAX_CONCURRENT_HANDSHAKES sets"));
    }
    Worker& worker = workers_.emplace_back();
    try {
      worker.thread = std::thread([&worker, handshake = std::move(handshake)] {
        handshake();
        worker.finished = true;
      });
    } catch (const std::system_error& error) {
      workers_.pop_back();
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot start a thread for the handshake: ", error.what()));
    }
    return absl::OkStatus();
  }

 private:
  struct Worker {
    std::thread thread;
    std::atomic<bool> finished{false};
  };
  const size_t max_concurrent_;
  std::list<Worker> workers_;  // list: a running thread holds a reference to its element
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_
