#include "cc/tf/runtime/stats.h"

namespace tf_rdma {

void Stats::Fallback(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_.fallback[reason]++;
}

void Stats::ReceivePlanned() {
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_.receives_planned++;
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
