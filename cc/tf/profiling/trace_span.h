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
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tsl/profiler/lib/traceme_encode.h"
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
  // gives its name and arguments (TransferEvent(...)), and runs only then. Once per span.
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

// A transfer's event, named `name`: the peer task, the backend ("none" before a connection), the
// bytes it moved (0 when it failed), its outcome, the step it served where it has one (a tf.data
// element has none), and one detail where given (`detail_key`=`detail`).
inline std::string TransferEvent(const char* name, absl::string_view peer, const char* backend, uint64_t bytes,
                                 std::optional<int64_t> step_id, const absl::Status& status,
                                 absl::string_view detail_key = {}, const absl::AlphaNum& detail = absl::AlphaNum("")) {
  std::string event = tsl::profiler::TraceMeEncode(
      name, {{"peer", peer}, {"backend", backend}, {"bytes", status.ok() ? bytes : 0},
             {"status", absl::StatusCodeToString(status.code())}});
  event.pop_back();  // the arguments' closing '#': more go before it
  if (step_id) absl::StrAppend(&event, ",step_id=", *step_id);
  if (!detail_key.empty()) absl::StrAppend(&event, ",", detail_key, "=", detail.Piece());
  event.push_back('#');
  return event;
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_PROFILING_TRACE_SPAN_H_
