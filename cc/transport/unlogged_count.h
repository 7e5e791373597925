// What a rate-limited log statement (absl's LOG_EVERY_N_SEC) left out: the line it does log says
// how many like it were not, so a flood of refusals reads as its size, not as one event.
#ifndef TF_RDMA_CC_TRANSPORT_UNLOGGED_COUNT_H_
#define TF_RDMA_CC_TRANSPORT_UNLOGGED_COUNT_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace tf_rdma {

// One per rate-limited statement: Occurred() each time it is reached, and the statement streams
// SinceLastLine() into the line it logs.
class UnloggedCount {
 public:
  void Occurred() { occurred_.fetch_add(1, std::memory_order_relaxed); }
  // "" or " (N more since the last such line, not logged)"; counting starts again.
  std::string SinceLastLine() {
    const uint64_t occurred = occurred_.exchange(0, std::memory_order_relaxed);
    if (occurred <= 1) return "";  // this line's own occurrence only
    return absl::StrCat(" (", occurred - 1, " more since the last such line, not logged)");
  }

 private:
  std::atomic<uint64_t> occurred_{0};
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_UNLOGGED_COUNT_H_
