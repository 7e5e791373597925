// What tf_rdma carried, so users can see it did: rewritten and fallback edges (with reasons), and
// transfers, bytes, grants and errors per peer and backend. Thread-safe; cheap on the hot path.
#ifndef TF_RDMA_CC_TF_RUNTIME_STATS_H_
#define TF_RDMA_CC_TF_RUNTIME_STATS_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace tf_rdma {

struct PeerStats {
  std::string backend;
  std::string backend_reason;
  uint64_t tensors_sent = 0;
  uint64_t bytes_sent = 0;
  uint64_t tensors_received = 0;
  uint64_t bytes_received = 0;
  uint64_t dead_tensors = 0;
  uint64_t grants = 0;
  uint64_t regrants = 0;  // a message outgrew its grant (sizes learned, shapes changed)
  uint64_t errors = 0;
  uint64_t sends_discarded = 0;  // writes the receiver no longer wanted (its step was cancelled)
  uint64_t connects = 0;
};

struct StatsSnapshot {
  uint64_t graphs_rewritten = 0;
  uint64_t edges_rewritten = 0;
  uint64_t receives_planned = 0;  // rewritten receives whose buffer size came from static shapes
  std::map<std::string, uint64_t> edges_fallback;  // reason -> count
  std::map<std::string, PeerStats> peers;          // peer task -> stats
};

class Stats {
 public:
  void GraphRewritten(uint64_t rewritten, uint64_t planned, const std::map<std::string, uint64_t>& fallback);
  // Runs `update` on the peer's record under the lock.
  template <typename F>
  void Peer(const std::string& task, F update) {
    std::lock_guard<std::mutex> lock(mu_);
    update(snapshot_.peers[task]);
  }
  StatsSnapshot Snapshot() const;
  void Reset();

 private:
  mutable std::mutex mu_;
  StatsSnapshot snapshot_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_STATS_H_
