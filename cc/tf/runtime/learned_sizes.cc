#include "cc/tf/runtime/learned_sizes.h"

namespace tf_rdma {
namespace {

constexpr size_t kMaxLearnedTransfers = 1 << 16;

}  // namespace

uint64_t LearnedSizes::Expected(const std::string& transfer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = bytes_.find(transfer);
  return it == bytes_.end() ? 0 : it->second;
}

void LearnedSizes::Learn(const std::string& transfer, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  // Forgetting costs one regrant per transfer; remembering everything could grow without bound.
  if (bytes_.size() >= kMaxLearnedTransfers && !bytes_.count(transfer)) bytes_.clear();
  bytes_[transfer] = bytes;
}

}  // namespace tf_rdma
