// Runs closures at their times, on one thread for the whole process: the deadlines of calls
// (CallOptions' timeout, RunOptions.timeout_in_ms), and the cancellations TensorFlow asks for
// under a lock of its own (CallOptions::StartCancel), which must complete elsewhere.
#ifndef TF_RDMA_CC_TF_CALLS_CALL_TIMER_H_
#define TF_RDMA_CC_TF_CALLS_CALL_TIMER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/time/time.h"

namespace tf_rdma {

class CallTimer {
 public:
  // The process's timer; its thread starts with the first closure and lives as long as the process.
  static CallTimer& Process();

  // Runs `closure` at `when` (at once, on the timer's thread, if that has passed); returns an id
  // for Cancel. Closures must not block: they delay every later one.
  uint64_t At(absl::Time when, std::function<void()> closure);
  // `closure` of `id` will not run, unless it runs already.
  void Cancel(uint64_t id);

 private:
  CallTimer() = default;
  void Run();

  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> due_;
  std::unordered_map<uint64_t, absl::Time> when_;
  uint64_t next_id_ = 1;
  bool started_ = false;  // its one thread
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_CALL_TIMER_H_
