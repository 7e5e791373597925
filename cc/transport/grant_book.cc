#include "cc/transport/grant_book.h"

namespace tf_rdma {

absl::Status CheckGrantRange(const MemoryRegion* region, uint64_t offset, uint64_t capacity) {
  if (region != nullptr && offset <= region->size() && capacity <= region->size() - offset) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("grant of [", offset, ", +", capacity,
                                                 ") does not fit in region of ",
                                                 region ? region->size() : 0, " bytes"));
}

absl::Status DiscardedWrite() {
  return absl::CancelledError("the receiver discarded this message's tag: its step was cancelled");
}

}  // namespace tf_rdma
