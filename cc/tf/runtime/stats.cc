#include "cc/tf/runtime/stats.h"

namespace tf_rdma {

void Stats::GraphRewritten(uint64_t rewritten, uint64_t planned, const std::map<std::string, uint64_t>& fallback) {
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_.graphs_rewritten++;
  snapshot_.edges_rewritten += rewritten;
  snapshot_.receives_planned += planned;
  for (const auto& [reason, count] : fallback) snapshot_.edges_fallback[reason] += count;
}

StatsSnapshot Stats::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_;
}

void Stats::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_ = StatsSnapshot();
}

}  // namespace tf_rdma
