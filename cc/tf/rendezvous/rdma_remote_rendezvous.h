// One step's remote rendezvous: which transfers tf_rdma carries, its receives (TensorReceive), its
// sends and fused messages, and what the step's abort or end does to those still pending.
#ifndef TF_RDMA_CC_TF_RENDEZVOUS_RDMA_REMOTE_RENDEZVOUS_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_RDMA_REMOTE_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/tf/planning/fusion.h"
#include "cc/tf/rendezvous/fused_receive.h"
#include "cc/tf/runtime/runtime.h"
#include "cc/transport/transport.h"
#include "tensorflow/core/distributed_runtime/base_rendezvous_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {

class RdmaRemoteRendezvous : public tensorflow::BaseRemoteRendezvous {
 public:
  RdmaRemoteRendezvous(const tensorflow::WorkerEnv* env, int64_t step_id, std::shared_ptr<Runtime> runtime,
                       tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> grpc)
      : BaseRemoteRendezvous(env, step_id), runtime_(std::move(runtime)), grpc_(std::move(grpc)) {
    runtime_->stats().StepStarted();
  }
  ~RdmaRemoteRendezvous() override { runtime_->stats().StepGone(phase_ == Phase::kFailed); }

  absl::Status Initialize(tensorflow::WorkerSession* session) override;

  void StartAbort(const absl::Status& status) override;

  absl::Status Send(const ParsedKey& parsed, const Rendezvous::Args& args, const tensorflow::Tensor& value,
                    bool is_dead) override;

  // The step's owner is done with it (cleanup). Returns whether the step had failed.
  bool End();

 private:
  // Send, with the step's own abort status (as the peer's failure set it) when it was stopped.
  absl::Status SendOrStopped(const ParsedKey& parsed, const Rendezvous::Args& args, const tensorflow::Tensor& value,
                             bool is_dead);

  // Withdraws the step's sends still waiting for their receiver's grant, and any it starts later:
  // the step was aborted or ended, and the receiver will not take them.
  void WithdrawPendingPushes(const absl::Status& status);

 protected:
  void RecvFromRemoteAsync(const ParsedKey& parsed, const Rendezvous::Args& args, DoneCallback done) override;

 private:
  // Both ends decide alike, from the key alone: CPU to CPU goes over tf_rdma, anything with a GPU
  // end stays on gRPC (counted).
  bool Carried(const ParsedKey& parsed);

  static constexpr char kRenamedTask[] =
      "a session that renames the tasks (ClusterSpec propagation): a tf_rdma server has one task name";

  void WarnRenamedOnce(const std::string& session_name);

  // A tensor as it travels: its header, and where its bytes come from (its own memory, or its
  // TensorProto for the types whose memory is not their value).
  struct Outgoing {
    TensorHeader header;
    std::shared_ptr<std::string> proto;
    const char* data = nullptr;
  };
  static Outgoing Describe(const tensorflow::Tensor& value, bool is_dead);

  void Push(const ParsedKey& parsed, const Rendezvous::Args& args, const std::string& peer_task,
            const tensorflow::Tensor& value, bool is_dead);

  // A send, kept for gRPC in case the peer turns out to be renamed.
  struct Member {
    std::string key;
    Rendezvous::Args args;
    tensorflow::Tensor value;
    bool is_dead;
    bool alone = false;  // a fused transfer's tensor that travels on its own
  };
  absl::Status SendOverGrpc(const Member& member);

  static void CountSent(Runtime& runtime, const std::string& peer_task, const std::string& tensor_name,
                        uint64_t bytes);

  struct Write {
    Tag tag;
    const char* bytes;
    uint64_t length;
  };
  // Writes a message (`writes`: its header's, and its data's if apart) to `peer_task`, `keep`
  // holding their bytes until the writes finish, as one of the step's pending pushes. A failed
  // write of a graph's transfer fails this task's step too (`fails_step`): the receiver may be a
  // task that waits on its own (it runs without tf_rdma, or died), and the step's owner must hear
  // why. An eager copy's does not: its rendezvous is the eager context's, which outlives every
  // step, and aborting it would fail every later copy to every peer; the copy's receiver fails on
  // its own (the connection ended, or never came). A peer the receiver's session renamed fetches
  // over gRPC instead (`over_grpc`). `sent` counts what went.
  // When every write of the message failed because this process closed the connection on the
  // peer's silence (TF_RDMA_PEER_TIMEOUT_MS), the message is sent once more (Deliver) over a new
  // connection: the peer may have been stopped and run again, and its receive, which had not
  // granted yet, then waits for this message on a connection only this side may dial if it sorts
  // earlier. Without it, that receive waited TF_RDMA_CONNECT_TIMEOUT_MS for a dial that never came
  // (docs/faults.md). Once only: a peer that goes silent again fails the message.
  // `event`: the name of its span in TensorFlow's profiler.
  void WriteTo(const char* event, const std::string& peer_task, std::string what, bool fails_step,
               const TransferTags& tags,
               std::vector<Write> writes, std::shared_ptr<void> keep,
               std::function<absl::Status(RdmaRemoteRendezvous&)> over_grpc, std::function<void()> sent);
  // A message WriteTo sends, shared by its writes' callbacks (rdma_remote_rendezvous_send.cc).
  struct MessageInFlight;
  // Writes `message` over the peer's connection (made or awaited first); `sent` once they started.
  static void Deliver(std::shared_ptr<MessageInFlight> message, std::function<void()> sent);

  // A fused transfer's tensor goes into its slot of the step's fused message to its peer, which
  // leaves once every member is in. One that does not fit its slot (it came larger than its static
  // shape planned) travels on its own, its slot saying so.
  absl::Status SendFused(const ParsedKey& parsed, const Rendezvous::Args& args, const std::string& peer_task,
                         const tensorflow::Tensor& value, bool is_dead, const FusedMember& member);

  // A step's fused message to one peer, filled as its members are sent.
  struct FusedSend {
    explicit FusedSend(const FusedMember& plan)
        : bytes(new char[plan.total]), total(plan.total), members(plan.count) {}
    const std::unique_ptr<char[]> bytes;
    const uint64_t total;
    std::vector<std::optional<Member>> members;  // kept for gRPC, should the peer be renamed
    uint32_t filled = 0;
    // The members in the message (not travelling on their own) and their bytes, for the stats.
    uint64_t tensors_in_message = 0;
    uint64_t bytes_in_message = 0;
  };

  // The step's fused message `member` belongs to, from the task that sends it; none once the step
  // was aborted (the receive then fails at once). Once every member has come for it, it leaves the
  // step's list: a function run again within the step (a loop's body) gets a message of its own,
  // as its sender fills a new one once the last was sent.
  absl::StatusOr<std::shared_ptr<FusedReceive>> FusedMessageFrom(const std::string& peer_task,
                                                                 const ParsedKey& parsed, const FusedMember& member);

  // The same fused transfer again before its message was complete: two runs of one graph overlap
  // within a step, and their members could not be told apart.
  static absl::Status TwiceInOneStep(std::string_view tensor_name);

  // The sends of this step whose writes have not all finished, so an aborted step can withdraw
  // them: the receiver's step is aborted too, and a receive it never issued would never discard
  // them (its Recv had not run yet, e.g. a later iteration of a loop), leaving the tensor held by
  // the connection until it closes. Returns the push's id, or nothing if the step was aborted.
  absl::Status Stopped();

  std::optional<uint64_t> TrackPush(const std::shared_ptr<Connection>& connection, const std::string& peer_task,
                                    const TransferTags& tags, bool has_data_write);
  void WriteFinished(uint64_t push);
  struct PendingPush {
    std::weak_ptr<Connection> connection;  // a closed connection has failed the writes already
    std::string peer_task;
    TransferTags tags;
    bool has_data_write;
    int writes_left;
  };

  const std::shared_ptr<Runtime> runtime_;
  const tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> grpc_;
  std::mutex pushes_mu_;
  enum class Phase { kRunning, kFailed, kEnded };
  Phase phase_ = Phase::kRunning;  // under pushes_mu_, but in the destructor
  absl::Status stopped_;  // why the step takes no more transfers (aborted, or ended); OK while it runs
  uint64_t next_push_ = 1;
  std::unordered_map<uint64_t, PendingPush> pending_pushes_;
  // This step's fused messages (cc/tf/planning/fusion.h) by group: being filled, and awaited.
  absl::flat_hash_map<uint64_t, std::shared_ptr<FusedSend>> fused_sends_;
  struct AwaitedMessage {
    std::shared_ptr<FusedReceive> message;
    std::vector<bool> members;  // which have come for it
    uint32_t attached = 0;
  };
  absl::flat_hash_map<uint64_t, AwaitedMessage> fused_receives_;  // those members still come for
  std::vector<std::shared_ptr<FusedReceive>> step_fused_receives_;  // all of the step's, for its end
  // The session runs this server under another task name than the server's own (ClusterSpec
  // propagation): the step's transfers stay on gRPC. The other end of each learns it when it
  // connects to this server and meets another name (Runtime::Renamed), and falls back alike.
  bool renamed_ = false;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_RDMA_REMOTE_RENDEZVOUS_H_
