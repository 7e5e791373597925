// A step's fused message from one peer (cc/tf/planning/fusion.h): one grant for all its members,
// and each member's slot handed to that member's receive once the message landed.
#ifndef TF_RDMA_CC_TF_RENDEZVOUS_FUSED_RECEIVE_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_FUSED_RECEIVE_H_

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "cc/tf/planning/fusion.h"
#include "cc/tf/profiling/trace_span.h"
#include "cc/tf/runtime/runtime.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

class FusedReceive : public std::enable_shared_from_this<FusedReceive> {
 public:
  // Runs once per member, on a transport thread or the caller's, never under a lock: with the
  // member's header message, or an empty one when the member travels on its own.
  using Deliver = std::function<void(const absl::Status&, std::string_view message)>;

  FusedReceive(std::shared_ptr<Runtime> runtime, std::string peer_task, int64_t step_id, Tag tag,
               const FusedMember& plan);

  // The first member grants the message; members attached after it landed get their slot at once.
  void Attach(const FusedMember& member, Deliver deliver);
  // The step ended or failed: the grant is taken back, the sender told not to send, and members
  // still waiting fail with `status`.
  void Abort(const absl::Status& status);

 private:
  struct Waiting {
    FusedMember member;
    Deliver deliver;
  };

  void Grant(std::shared_ptr<Connection> connection);
  void OnLanded(const GrantResult& result, const std::shared_ptr<PoolBuffer>& buffer);
  void Fail(const absl::Status& cause);
  // Counts members handed their slot; the buffer goes back to the pool after the last.
  void HandedOutLocked(size_t members);
  static void DeliverSlot(const PoolBuffer& buffer, const Waiting& waiting, const std::string& peer_task);
  void EndSpanLocked(const absl::Status& outcome);

  const std::shared_ptr<Runtime> runtime_;
  const std::string peer_task_;
  const int64_t step_id_;
  const Tag tag_;
  const uint64_t total_;
  const uint32_t count_;

  // Recursive: a grant on a connection that already failed completes inside Grant().
  std::recursive_mutex mu_;
  bool started_ = false;
  absl::Status failure_;
  std::shared_ptr<Connection> connection_;
  uint64_t grant_id_ = 0;
  std::shared_ptr<PoolBuffer> landed_;
  uint32_t handed_out_ = 0;
  std::vector<Waiting> waiting_;
  TraceSpan span_;  // from the grant to the message landing, or the receive's end without it
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_FUSED_RECEIVE_H_
