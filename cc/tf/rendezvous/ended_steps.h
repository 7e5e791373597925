#ifndef TF_RDMA_CC_TF_RENDEZVOUS_ENDED_STEPS_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_ENDED_STEPS_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "cc/tf/rendezvous/rdma_remote_rendezvous.h"

namespace tf_rdma {

// TensorFlow keeps a reference, for the life of the process, to every step rendezvous it aborts
// (LocalRendezvous::StartAbort: a late lookup of the step still finds its error). The base manager's
// Cleanup aborts a step's rendezvous whenever anything still holds it, if only for a moment (a
// thread between a receive's callback and its Unref, a write completing), so over a long run such
// rendezvous piled up: the soak's worker grew by about 0.65 KiB a step. So when a step ends, its
// own pending sends are withdrawn (they hold it) and its rendezvous is aborted only if it is still
// held kGrace later; otherwise it goes when its last holder lets go, and its cache entry with it.
// Held steps are looked at by the cleanups that follow (no timer thread): by then the step's own
// executors are done, so what a late abort fails is only what outlived the step (a peer's gRPC
// fetch its caller gave up on), which a process running no more steps keeps until it runs one.
class EndedSteps : public std::enable_shared_from_this<EndedSteps> {
 public:
  // Runs under the cache's lock, which the destruction of a rendezvous takes: must not drop a
  // reference to one.
  void Started(int64_t step_id, RdmaRemoteRendezvous* rendezvous);

  // Returns whether the step's abort waits: its rendezvous is still held, and not because it failed
  // (TensorFlow holds those for good; the base cleanup applies to them).
  bool Ended(int64_t step_id);

  // The ended steps whose rendezvous is still held after kGrace.
  std::vector<int64_t> TakeOverdue();

  void Clear();

 private:
  static constexpr std::chrono::milliseconds kGrace{1000};

  struct Live {
    tsl::core::WeakPtr<RdmaRemoteRendezvous> rendezvous;
    const RdmaRemoteRendezvous* identity;  // a later rendezvous of the same step replaces it
  };
  struct Held {
    int64_t step_id;
    tsl::core::WeakPtr<RdmaRemoteRendezvous> rendezvous;
    std::chrono::steady_clock::time_point deadline;
  };

  void Forget(int64_t step_id, const RdmaRemoteRendezvous* gone);

  std::mutex mu_;
  absl::flat_hash_map<int64_t, Live> live_;
  std::deque<Held> held_;  // in the order the steps ended, so deadlines ascend
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_ENDED_STEPS_H_
