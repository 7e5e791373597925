// The I/O threads of a transport: a fixed number (TF_RDMA_IO_THREADS) of epoll loops that every
// connection of the transport shares, so that a process serving a thousand peers runs a handful of
// threads, not one or two per peer. Each connection belongs to one loop for its life: its
// descriptor's events and its heartbeat checks all run on that loop's thread, one at a time. A
// stream connection's descriptor is its socket; a verbs connection's is an epoll descriptor of its
// own that holds its completion channel, rdma_cm event channel and wake-up eventfd.
#ifndef TF_RDMA_CC_TRANSPORT_IO_LOOPS_H_
#define TF_RDMA_CC_TRANSPORT_IO_LOOPS_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tf_rdma {

// What a loop serves: one descriptor. Called on the loop's thread only.
class IoHandler {
 public:
  virtual ~IoHandler() = default;
  enum class Progress {
    kWaiting,   // for the descriptor's next event
    kMore,      // work is left that no event will announce (bytes already read): call again soon
    kFinished,  // the handler is done, and the loop lets go of it
  };
  // The descriptor is readable, writable or hung up (epoll `events`; the next call after kMore
  // has EPOLLIN, whatever event brought it). Each call does a bounded amount of work, so that one busy peer cannot starve the
  // loop's other connections.
  virtual Progress OnEvents(uint32_t events) = 0;
  // Called every tick (IoLoops' `tick`): heartbeats and silence checks. False as for OnEvents.
  virtual bool OnTick(absl::Time now) = 0;
  // The loop stops (the transport goes away): last call but OnRemoved.
  virtual void OnLoopStopped() = 0;
  // The loop let go of the handler (it finished, or the loop stopped) and no longer watches its
  // descriptor: the very last call, after which the handler may release the descriptor.
  virtual void OnRemoved() = 0;
};

class IoLoop {
 public:
  // `poll_window`: how long the loop keeps polling its descriptors without sleeping after it last
  // served an event (see IoLoops).
  IoLoop(int epoll_fd, int wake_fd, absl::Duration tick, absl::Duration poll_window);
  ~IoLoop();
  IoLoop(const IoLoop&) = delete;
  IoLoop& operator=(const IoLoop&) = delete;

  // Serves `fd` with `handler` (readable events, plus writable ones while asked for).
  absl::Status Add(int fd, std::shared_ptr<IoHandler> handler);
  // Whether the loop also reports `fd` (served by `handler`) writable. Callers serialize calls
  // per fd and keep `fd` open meanwhile; after the handler was let go of, this does nothing.
  void WatchWritable(int fd, IoHandler* handler, bool writable);

  void Run();
  void Stop();

 private:
  void Remove(IoHandler* handler);

  const int epoll_fd_;
  const int wake_fd_;
  const absl::Duration tick_;
  const absl::Duration poll_window_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::unordered_map<IoHandler*, std::pair<int, std::shared_ptr<IoHandler>>> handlers_;
};

class IoLoops {
 public:
  // `threads` loops; `tick` paces OnTick. After serving an event a loop keeps polling (epoll with no
  // wait) for `poll_window` before it sleeps, so that an answer arriving meanwhile, as in a
  // request/response exchange, is read without a thread wake-up, which costs more than the hop
  // itself on an idle core. Zero: sleep at once. (A loop whose thread may run on one core only
  // does not poll: it would keep the core from whatever it waits for.)
  IoLoops(size_t threads, absl::Duration tick, absl::Duration poll_window = absl::ZeroDuration())
      : threads_(threads), tick_(tick), poll_window_(poll_window) {}
  // Stops every loop and joins its thread; handlers still served get OnLoopStopped.
  ~IoLoops();
  IoLoops(const IoLoops&) = delete;
  IoLoops& operator=(const IoLoops&) = delete;

  // Starts the loops' threads (those not running yet): a transport's threads are there from its
  // start, whatever comes to connect.
  absl::Status Start();
  // The loop the next connection goes to (round robin); loops that could not start are tried again.
  absl::StatusOr<std::shared_ptr<IoLoop>> Next();

 private:
  absl::Status StartLocked();

  const size_t threads_;
  const absl::Duration tick_;
  const absl::Duration poll_window_;
  std::mutex mu_;
  size_t next_ = 0;
  std::vector<std::shared_ptr<IoLoop>> loops_;
  std::vector<std::thread> threads_running_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_IO_LOOPS_H_
