// What tf_rdma carried, so users can see it did: per peer its backend, transfers, bytes by kind,
// grants and errors, and what stayed on gRPC with the reason. Thread-safe; cheap on the hot path.
#ifndef TF_RDMA_CC_TF_RUNTIME_STATS_H_
#define TF_RDMA_CC_TF_RUNTIME_STATS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace tf_rdma {

// Kinds of transfer, as stats() reports bytes by kind.
inline constexpr char kKindGraph[] = "graph";            // a partitioned graph's or function's _Send/_Recv
inline constexpr char kKindEager[] = "eager";            // an eager copy between tasks
inline constexpr char kKindCollective[] = "collective";  // a collective's buffer (all-reduce, ...)

struct PeerStats {
  std::string backend;
  std::string backend_reason;
  uint64_t tensors_sent = 0;
  uint64_t bytes_sent = 0;
  uint64_t tensors_received = 0;
  uint64_t bytes_received = 0;
  std::map<std::string, uint64_t> bytes_sent_by_kind;
  std::map<std::string, uint64_t> bytes_received_by_kind;
  uint64_t dead_tensors = 0;
  uint64_t grants = 0;
  uint64_t regrants = 0;  // a message outgrew its grant (a transfer's first time, or it grew)
  uint64_t errors = 0;
  uint64_t sends_discarded = 0;  // writes dropped because their step was cancelled (either side)
  // Messages sent again over a new connection, the first having ended on the peer's silence.
  uint64_t resends = 0;
  uint64_t connects = 0;
  // Connections that only asked the peer who it is and to dial back (a task waits for the peer to
  // connect, as the one whose name sorts first does), each end counting its own.
  uint64_t probes = 0;
  // Messages that carried a step's fused transfers (cc/tf/planning/fusion.h); their tensors count
  // in tensors_sent and tensors_received like the others.
  uint64_t fused_messages_sent = 0;
  uint64_t fused_messages_received = 0;
  // Worker-service calls by method ("RunGraph"): made to the peer, and served for it.
  std::map<std::string, uint64_t> calls_made;
  std::map<std::string, uint64_t> calls_served;
  // Worker-service calls to the peer that stayed on gRPC, by method: device discovery (GetStatus),
  // a fetch with a GPU end (RecvTensor, RecvBuf), and any call of a session that renamed tasks.
  std::map<std::string, uint64_t> calls_on_grpc;
};

struct StatsSnapshot {
  uint64_t receives_planned = 0;  // receives whose first grant was sized from static shapes
  std::map<std::string, uint64_t> fallback;  // reason -> transfers left on gRPC
  std::map<std::string, PeerStats> peers;    // peer task -> stats
};

class Stats {
 public:
  void Fallback(const std::string& reason);
  void ReceivePlanned();
  // Runs `update` on the peer's record under the lock.
  template <typename F>
  void Peer(const std::string& task, F update) {
    std::lock_guard<std::mutex> lock(mu_);
    update(snapshot_.peers[task]);
  }
  StatsSnapshot Snapshot() const;
  void Reset();  // the counts, not the steps alive: those are a state

  // Steps whose rendezvous is alive now (live_steps): those running, and ended ones something still
  // holds (for microseconds, as a rule). A number that keeps growing over a run means ended steps
  // are held for good: memory leaked.
  // Except failed steps (cancelled, or an error): TensorFlow keeps their rendezvous for the life of
  // the process (stock servers too), counted apart (failed_steps_kept).
  void StepStarted() { live_steps_.fetch_add(1, std::memory_order_relaxed); }
  void StepFailed() {
    live_steps_.fetch_sub(1, std::memory_order_relaxed);
    failed_steps_kept_.fetch_add(1, std::memory_order_relaxed);
  }
  void StepGone(bool failed) {
    (failed ? failed_steps_kept_ : live_steps_).fetch_sub(1, std::memory_order_relaxed);
  }
  int64_t live_steps() const { return live_steps_.load(std::memory_order_relaxed); }
  int64_t failed_steps_kept() const { return failed_steps_kept_.load(std::memory_order_relaxed); }

 private:
  mutable std::mutex mu_;
  StatsSnapshot snapshot_;
  std::atomic<int64_t> live_steps_{0};
  std::atomic<int64_t> failed_steps_kept_{0};
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_STATS_H_
