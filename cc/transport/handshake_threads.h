// The threads a listener runs accepted connections' handshakes on, one each, so that a slow client
// holds up only its own handshake. A client gets one only once it sent its first byte (see
// StreamListener), and at most TransportLimits::max_concurrent_handshakes run at once, at most
// half of them for clients from one source address: each holds a thread and a descriptor until
// the client finishes or the connect timeout passes, and a flood of clients from one place must
// neither exhaust either nor lock the others out. Finished threads are joined as new ones start;
// the rest when this goes, so nothing a listener started outlives it. Used by one thread (the
// listener's accept loop), then destroyed after it stopped.
#ifndef TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_
#define TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_

#include <algorithm>
#include <atomic>
#include <functional>
#include <list>
#include <string>
#include <system_error>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {

class HandshakeThreads {
 public:
  explicit HandshakeThreads(size_t max_concurrent)
      : max_concurrent_(max_concurrent), max_per_source_(std::max<size_t>(1, max_concurrent / 2)) {}
  HandshakeThreads(const HandshakeThreads&) = delete;
  HandshakeThreads& operator=(const HandshakeThreads&) = delete;
  ~HandshakeThreads() {
    for (auto& worker : workers_) worker.thread.join();
  }

  // Runs `handshake` for a client from `source` on a thread of its own. Fails with
  // kResourceExhausted, without running it, when a limit of concurrent handshakes is reached or no
  // thread can be started (pids limit, address space); the caller then refuses that client (who
  // tries again after a while) and keeps serving.
  absl::Status Start(const std::string& source, std::function<void()> handshake) {
    size_t from_source = 0;
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->finished) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        from_source += it->source == source;
        ++it;
      }
    }
    if (workers_.size() >= max_concurrent_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many concurrent handshakes: ", workers_.size(),
          " clients are handshaking, the limit TF_RDMA_MAX_CONCURRENT_HANDSHAKES sets"));
    }
    if (from_source >= max_per_source_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many concurrent handshakes from ", source, ": ", from_source,
          " of its clients are handshaking, half the limit TF_RDMA_MAX_CONCURRENT_HANDSHAKES sets"));
    }
    Worker& worker = workers_.emplace_back();
    worker.source = source;
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
    std::string source;
    std::atomic<bool> finished{false};
  };
  const size_t max_concurrent_;
  const size_t max_per_source_;
  std::list<Worker> workers_;  // list: a running thread holds a reference to its element
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_HANDSHAKE_THREADS_H_
