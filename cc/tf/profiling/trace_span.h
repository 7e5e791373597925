// tf_rdma's work as events of TensorFlow's profiler (tf.profiler.experimental.start, Keras'
// TensorBoard(profile_batch=...)): TensorBoard's trace viewer shows each as a span with its peer
// task, backend, bytes and step id beside the step's ops.
//
// A span ends on another thread than it started on, often (a send's last write completes on a
// transport thread), and what it carried is known only at its end (a receive's bytes), so it is
// recorded whole at its end, with its start time, on the ending thread. With no profiler
// recording, a span costs one atomic load of TensorFlow's trace level at either end; a build
// with -DTF_RDMA_NO_TRACE_EVENTS has none at all (to measure that cost against).
#ifndef TF_RDMA_CC_TF_PROFILING_TRACE_SPAN_H_
#define TF_RDMA_CC_TF_PROFILING_TRACE_SPAN_H_

#include <cstdint>
#include <string>
#include <utility>

#ifndef TF_RDMA_NO_TRACE_EVENTS
#include "tsl/profiler/lib/traceme.h"
#endif

namespace tf_rdma {

class TraceSpan {
 public:
  // Begins a span when a profiler records now.
  static TraceSpan Start() {
    TraceSpan span;
#ifndef TF_RDMA_NO_TRACE_EVENTS
    if (tsl::profiler::TraceMe::Active(kLevel)) span.start_ns_ = tsl::profiler::GetCurrentTimeNanos();
#endif
    return span;
  }

  // Records the span, if it began while a profiler recorded and one still does. `describe()`
  // gives its name and arguments (tsl::profiler::TraceMeEncode("tf_rdma send", {{"peer", ...}})),
  // and runs only then. Once per span.
  template <typename Describe>
  void End(Describe&& describe) {
#ifndef TF_RDMA_NO_TRACE_EVENTS
    if (start_ns_ == 0) return;
    const int64_t start = std::exchange(start_ns_, 0);
    if (!tsl::profiler::TraceMe::Active(kLevel)) return;
    tsl::profiler::TraceMeRecorder::Record(
        {std::forward<Describe>(describe)(), start, tsl::profiler::GetCurrentTimeNanos()});
#endif
  }

  bool recording() const { return start_ns_ != 0; }

 private:
  // TraceMe's level 1, "critical": recorded at the profiler's default host tracer level (2) and
  // at every level above it.
  static constexpr int kLevel = 1;
  int64_t start_ns_ = 0;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_PROFILING_TRACE_SPAN_H_
