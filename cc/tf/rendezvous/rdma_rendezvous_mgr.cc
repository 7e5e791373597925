#include "cc/tf/rendezvous/rdma_rendezvous_mgr.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/log/log.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/planning/fusion.h"
#include "cc/tf/planning/static_sizes.h"
#include "cc/tf/rendezvous/fused_receive.h"
#include "cc/tf/runtime/pool_tensor_buffer.h"
#include "cc/tf/rendezvous/tensor_message.h"
#include "tensorflow/core/distributed_runtime/base_rendezvous_mgr.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor.pb.h"
#include "tensorflow/core/platform/env.h"

namespace tf_rdma {
namespace {

using tensorflow::Rendezvous;
using tensorflow::Tensor;

std::string TaskName(const tensorflow::DeviceNameUtils::ParsedName& device) {
  return absl::StrCat("/job:", device.job, "/replica:", device.replica, "/task:", device.task);
}

// Graph partitions name their transfers edge_<id>_<node>; eager copies do not.
const char* KindOf(std::string_view tensor_name) {
  return absl::StartsWith(tensor_name, "edge_") ? kKindGraph : kKindEager;
}

// The transfer without its frame and iteration: what a loop's iterations have in common, so the
// size one iteration carried is the grant of the next.
std::string TransferName(std::string_view full_key) {
  return std::string(full_key.substr(0, full_key.rfind(';')));
}

// One receive: the header and data grants, and the tensor they make.
class TensorReceive : public std::enable_shared_from_this<TensorReceive> {
 public:
  using Done = std::function<void(const absl::Status&, const Tensor&, bool is_dead)>;

  // A fused transfer's header message comes in its slot of `fused`, the step's fused message.
  struct FusedSlot {
    std::shared_ptr<FusedReceive> message;
    FusedMember member;
  };

  // `key` is the rendezvous key of the transfer.
  TensorReceive(std::shared_ptr<Runtime> runtime, std::string peer_task, std::string key, int64_t step_id,
                std::string tensor_name, std::optional<FusedSlot> fused, Done done)
      : runtime_(std::move(runtime)), peer_task_(std::move(peer_task)), key_(std::move(key)), step_id_(step_id),
        tensor_name_(std::move(tensor_name)), fused_(std::move(fused)), done_(std::move(done)) {}

  void Start() {
    if (!fused_) return StartGrants();
    fused_->message->Attach(fused_->member, [self = shared_from_this()](const absl::Status& status,
                                                                         std::string_view message) {
      self->OnFusedSlot(status, message);
    });
  }

  // The step ended without this tensor: FinishLocked gives the grants back and tells the sender
  // not to send. A receive that finished already did both.
  void Abort(const absl::Status& status) {
    Locked lock(this);
    FinishLocked(status);
  }

  void Finish(const absl::Status& status) {
    Locked lock(this);
    FinishLocked(status);
  }

 private:
  // Only a tensor with grants of its own needs its tags and its sizes learned (a fused member's
  // come planned in its slot): hashing them per fused tensor would cost more than the rest.
  void StartGrants() {
    {
      Locked lock(this);
      tags_ = TagsFor(key_, step_id_);
      transfer_ = TransferName(key_);
    }
    runtime_->WithConnection(peer_task_, [self = shared_from_this()](
                                             absl::StatusOr<std::shared_ptr<Connection>> connection) {
      if (!connection.ok()) return self->Finish(connection.status());
      self->Grant(std::move(*connection));
    });
  }

  void OnFusedSlot(const absl::Status& status, std::string_view message) {
    if (status.ok() && message.empty()) {
      // It came larger than its static shape planned, so it travels on its own.
      return StartGrants();
    }
    Locked lock(this);
    if (finished_) return;
    if (!status.ok()) return FinishLocked(status);
    runtime_->stats().ReceivePlanned();
    OnHeaderMessageLocked(message.data(), message.size(), /*fused=*/true);
  }

  void Grant(std::shared_ptr<Connection> connection) {
    absl::StatusOr<std::shared_ptr<BufferPool>> pool = runtime_->PoolFor(connection);
    Locked lock(this);
    if (finished_) return;
    if (!pool.ok()) return FinishLocked(pool.status());
    connection_ = std::move(connection);
    pool_ = *pool;
    absl::Status granted = GrantLocked(tags_.header, kHeaderMessageCapacity, true);
    // A tensor expected small comes inside the header's message; if it turns out larger, its
    // header says so and the data is granted then.
    const uint64_t expected = FirstGrantBytes();
    if (granted.ok() && expected > kInlineBytes) granted = GrantLocked(tags_.data, expected, false);
    if (!granted.ok()) FinishLocked(granted);
  }

  // What this transfer carried last time; for its first crossing, what the static shapes planned.
  uint64_t FirstGrantBytes() {
    const uint64_t learned = runtime_->ExpectedBytes(transfer_);
    if (learned != 0) return learned;
    const std::optional<uint64_t> planned = PlannedBytes(transfer_);
    if (!planned) return 0;
    runtime_->stats().ReceivePlanned();
    return *planned;
  }

  absl::Status GrantLocked(const Tag& tag, uint64_t capacity, bool is_header) {
    absl::StatusOr<std::unique_ptr<PoolBuffer>> allocated = pool_->Allocate(capacity);
    if (!allocated.ok()) return allocated.status();
    std::shared_ptr<PoolBuffer> buffer = std::move(*allocated);
    uint64_t& id = is_header ? header_grant_ : data_grant_;
    // The buffer stays with the grant's callback until the grant completes, whatever happens to
    // the receive meanwhile: nothing else may use it while the peer may still write it.
    id = connection_->Grant(tag, buffer->region(), buffer->offset(), capacity,
                            [self = shared_from_this(), buffer, is_header](const GrantResult& r) {
                              if (is_header) {
                                self->OnHeader(r, *buffer);
                              } else {
                                self->OnData(r, buffer);
                              }
                            });
    runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.grants++; });
    return absl::OkStatus();
  }

  void OnHeader(const GrantResult& result, const PoolBuffer& buffer) {
    Locked lock(this);
    if (finished_) return;
    if (!result.status.ok()) return FinishLocked(result.status);
    OnHeaderMessageLocked(buffer.data(), result.length, /*fused=*/false);
  }

  void OnHeaderMessageLocked(const char* message, uint64_t length, bool fused) {
    uint64_t data_offset = 0;
    absl::StatusOr<TensorHeader> header = DecodeHeader(message, length, &data_offset);
    if (!header.ok()) return FinishLocked(header.status());
    header_ = *header;
    if (TravelsInline(*header_)) {
      // Nothing comes under the data tag: a data grant made for a larger tensor is taken back,
      // once the receive finished so its completion finds nothing to do.
      if (header_->dead) {
        runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.dead_tensors++; });
        dead_ = true;
        FinishLocked(absl::OkStatus());
      } else {
        OutputLocked(message + data_offset, nullptr);
      }
      return;
    }
    if (fused) {
      // A fused member's bytes are in its slot: no data grant is made for it.
      return FinishLocked(absl::DataLossError("the peer's fused message announced a tensor outside its slot"));
    }
    if (data_grant_ == 0 || needed_bytes_ != 0) {
      absl::Status regranted = data_grant_ == 0 ? GrantDataLocked() : RegrantLocked();
      if (!regranted.ok()) return FinishLocked(regranted);
    }
    MaybeOutputLocked();
  }

  void OnData(const GrantResult& result, std::shared_ptr<PoolBuffer> buffer) {
    Locked lock(this);
    if (finished_) return;
    if (result.status.code() == absl::StatusCode::kResourceExhausted) {
      // The tensor outgrew what this transfer carried before. The size the sender asks for is
      // granted only once its header confirms it: a peer's word alone must not size our memory.
      needed_bytes_ = result.length;
      if (!header_) return;
      absl::Status regranted = RegrantLocked();
      if (!regranted.ok()) FinishLocked(regranted);
      return;
    }
    if (!result.status.ok()) return FinishLocked(result.status);
    data_ = std::move(buffer);
    data_length_ = result.length;
    MaybeOutputLocked();
  }

  absl::Status RegrantLocked() {
    const uint64_t needed = needed_bytes_;
    needed_bytes_ = 0;
    if (header_->dead) return absl::OkStatus();  // its data grant is being revoked
    if (needed != header_->data_bytes) {
      return absl::DataLossError(absl::StrCat("the peer asked for ", needed, " bytes but its header announced ",
                                              header_->data_bytes));
    }
    return GrantDataLocked();
  }

  // The data grant its header asked for: the tensor was expected small, or larger than it came.
  absl::Status GrantDataLocked() {
    runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.regrants++; });
    return GrantLocked(tags_.data, header_->data_bytes, false);
  }

  void MaybeOutputLocked() {
    if (!header_ || !data_) return;
    if (header_->data_bytes != data_length_) {
      return FinishLocked(absl::DataLossError(absl::StrCat(
          "the header announced ", header_->data_bytes, " bytes but ", data_length_, " landed")));
    }
    const char* bytes = data_->data();
    OutputLocked(bytes, std::move(data_));
  }

  // The tensor from its header and `bytes` (header_->data_bytes of them). A memcpy-able tensor
  // aliases `landed`, their pool buffer, when given; else (inline bytes, in the header's buffer,
  // which goes back to the pool) it is copied out.
  void OutputLocked(const char* bytes, std::shared_ptr<PoolBuffer> landed) {
    const uint64_t length = header_->data_bytes;
    if (!transfer_.empty()) runtime_->Learn(transfer_, length);
    if (TravelsAsBytes(header_->dtype) && landed) {
      auto* storage = new PoolTensorBuffer(std::move(landed), length);
      tensor_ = Tensor(header_->dtype, header_->shape, storage);
      storage->Unref();  // the tensor holds the only reference now
    } else if (TravelsAsBytes(header_->dtype)) {
      tensor_ = Tensor(header_->dtype, header_->shape);
      if (length != 0) std::memcpy(const_cast<char*>(tensor_.tensor_data().data()), bytes, length);
    } else {
      absl::StatusOr<Tensor> parsed = TensorFromProtoBytes(*header_, std::string_view(bytes, length));
      if (!parsed.ok()) return FinishLocked(parsed.status());
      tensor_ = *std::move(parsed);
    }
    const char* kind = KindOf(tensor_name_);
    runtime_->stats().Peer(peer_task_, [length, kind](PeerStats& s) {
      s.tensors_received++;
      s.bytes_received += length;
      s.bytes_received_by_kind[kind] += length;
    });
    FinishLocked(absl::OkStatus());
  }

  void FinishLocked(const absl::Status& status) {
    if (finished_) return;
    finished_ = true;
    status_ = status;
    // Whatever ended the receive (its tensor, a bad header, a failed regrant, the step's end),
    // no grant may outlive it: each holds a pool buffer until the peer writes it or it is taken
    // back (a data grant outstanding after the header came inline is simply not needed).
    // Revoking a grant that completed already does nothing.
    if (connection_) {
      if (header_grant_ != 0) connection_->Revoke(header_grant_);
      if (data_grant_ != 0) connection_->Revoke(data_grant_);
      if (!status.ok()) {
        // Without this the sender would keep the tensor until the connection closes.
        connection_->Discard(tags_.header);
        connection_->Discard(tags_.data);
      }
    }
    if (!status.ok() && !absl::IsCancelled(status)) {
      runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.errors++; });
      status_ = TaskFailure(absl::StrCat("receiving '", tensor_name_, "' from"), peer_task_, status);
    }
    // done_ runs when the outermost Locked lets go; later grant completions only release buffers.
  }

  // Holds mu_; the outermost one on a thread runs done_ once the receive finished, unlocked:
  // TensorFlow may run downstream kernels inline in it, on the transport's thread.
  class Locked {
   public:
    explicit Locked(TensorReceive* receive) : receive_(receive) {
      receive_->mu_.lock();
      ++receive_->lock_depth_;
    }
    ~Locked() {
      Done done;
      if (--receive_->lock_depth_ == 0 && receive_->finished_) std::swap(done, receive_->done_);
      receive_->mu_.unlock();
      if (done) done(receive_->status_, receive_->tensor_, receive_->dead_);
    }

   private:
    TensorReceive* const receive_;
  };

  const std::shared_ptr<Runtime> runtime_;
  const std::string peer_task_;
  const std::string key_;
  const int64_t step_id_;
  const std::string tensor_name_;
  const std::optional<FusedSlot> fused_;
  Done done_;

  // Recursive: a grant on a connection that already failed completes inside Grant().
  std::recursive_mutex mu_;
  int lock_depth_ = 0;
  bool finished_ = false;
  absl::Status status_;
  Tensor tensor_;
  bool dead_ = false;
  TransferTags tags_;
  std::string transfer_;  // the key less its frame and iteration
  std::shared_ptr<Connection> connection_;
  std::shared_ptr<BufferPool> pool_;
  uint64_t header_grant_ = 0;
  uint64_t data_grant_ = 0;
  std::optional<TensorHeader> header_;
  std::shared_ptr<PoolBuffer> data_;
  uint64_t data_length_ = 0;
  uint64_t needed_bytes_ = 0;  // a too-small data grant's needed size, until the header vouches for it
};

// A receive as the base rendezvous tracks it, so step aborts and cancellation reach it.
class RdmaRecvCall : public tensorflow::BaseRecvTensorCall {
 public:
  explicit RdmaRecvCall(std::function<std::shared_ptr<TensorReceive>(TensorReceive::Done)> make)
      : make_(std::move(make)) {}

  void Start(std::function<void()> recv_done) override {
    std::shared_ptr<TensorReceive> receive =
        make_([this, recv_done](const absl::Status& status, const Tensor& tensor, bool dead) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            if (status_.ok()) status_ = status;
            tensor_ = tensor;
            dead_ = dead;
          }
          recv_done();
        });
    absl::Status aborted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      receive_ = receive;
      aborted = status_;
    }
    // Finishing runs the callback above, which takes mu_: never under it.
    if (!aborted.ok()) return receive->Finish(aborted);
    receive->Start();
  }

  // Called under the rendezvous's locks: the receive finishes on another thread.
  void StartAbort(const absl::Status& status) override {
    std::shared_ptr<TensorReceive> receive;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.ok()) status_ = status;
      receive = receive_;
    }
    if (receive) tensorflow::Env::Default()->SchedClosure([receive, status] { receive->Abort(status); });
  }

  absl::Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  const Tensor& tensor() const { return tensor_; }
  bool dead() const { return dead_; }

 private:
  const std::function<std::shared_ptr<TensorReceive>(TensorReceive::Done)> make_;
  mutable std::mutex mu_;
  absl::Status status_;
  std::shared_ptr<TensorReceive> receive_;
  Tensor tensor_;
  bool dead_ = false;
};

class RdmaRemoteRendezvous : public tensorflow::BaseRemoteRendezvous {
 public:
  RdmaRemoteRendezvous(const tensorflow::WorkerEnv* env, int64_t step_id, std::shared_ptr<Runtime> runtime,
                       tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> grpc)
      : BaseRemoteRendezvous(env, step_id), runtime_(std::move(runtime)), grpc_(std::move(grpc)) {
    runtime_->stats().StepStarted();
  }
  ~RdmaRemoteRendezvous() override { runtime_->stats().StepGone(phase_ == Phase::kFailed); }

  absl::Status Initialize(tensorflow::WorkerSession* session) override {
    absl::Status status = BaseRemoteRendezvous::Initialize(session);
    if (!status.ok()) return status;
    renamed_ = session->worker_name() != runtime_->local_task();
    if (renamed_) WarnRenamedOnce(session->worker_name());
    return grpc_->Initialize(session);
  }

  void StartAbort(const absl::Status& status) override {
    {
      std::lock_guard<std::mutex> lock(pushes_mu_);
      if (phase_ == Phase::kRunning) {
        // The step's own failure (cancelled, an op's error, a transfer's): TensorFlow keeps its
        // rendezvous for the life of the process from now on (LocalRendezvous::StartAbort).
        phase_ = Phase::kFailed;
        runtime_->stats().StepFailed();
      }
    }
    WithdrawPendingPushes(status);
    BaseRemoteRendezvous::StartAbort(status);
    grpc_->StartAbort(status);
  }

  absl::Status Send(const ParsedKey& parsed, const Rendezvous::Args& args, const Tensor& value,
                    bool is_dead) override {
    if (IsSameWorker(parsed.src, parsed.dst)) return BaseRemoteRendezvous::Send(parsed, args, value, is_dead);
    if (!Carried(parsed)) return BaseRemoteRendezvous::Send(parsed, args, value, is_dead);
    // A step that was aborted or ended takes no transfer: the send fails with why, as TensorFlow's
    // own rendezvous does, rather than vanish while its receiver waits.
    absl::Status stopped = Stopped();
    if (!stopped.ok()) return stopped;
    if (std::optional<FusedMember> member = ParseFusedMember(parsed.edge_name)) {
      return SendFused(parsed, args, TaskName(parsed.dst), value, is_dead, *member);
    }
    Push(parsed, args, TaskName(parsed.dst), value, is_dead);
    return absl::OkStatus();
  }

  // The step's owner is done with it (cleanup). Returns whether the step had failed.
  bool End() {
    bool failed;
    {
      std::lock_guard<std::mutex> lock(pushes_mu_);
      if (phase_ == Phase::kRunning) phase_ = Phase::kEnded;
      failed = phase_ == Phase::kFailed;
    }
    WithdrawPendingPushes(absl::CancelledError("the step ended"));
    return failed;
  }

 private:
  // Withdraws the step's sends still waiting for their receiver's grant, and any it starts later:
  // the step was aborted or ended, and the receiver will not take them.
  void WithdrawPendingPushes(const absl::Status& status) {
    std::vector<PendingPush> pending;
    std::vector<std::shared_ptr<FusedReceive>> fused_receives;
    {
      std::lock_guard<std::mutex> lock(pushes_mu_);
      if (stopped_.ok()) stopped_ = status.ok() ? absl::CancelledError("the step ended") : status;
      for (auto& [id, push] : pending_pushes_) pending.push_back(std::move(push));
      pending_pushes_.clear();
      // A fused message some member never completed goes unsent.
      fused_sends_.clear();
      fused_receives.swap(step_fused_receives_);
      fused_receives_.clear();
    }
    // Those that landed only let go of nothing; the others take their grant back.
    for (const std::shared_ptr<FusedReceive>& message : fused_receives) message->Abort(status);
    // Outside the lock: a withdrawn write's callback runs here and finishes its push.
    for (const PendingPush& push : pending) {
      if (std::shared_ptr<Connection> connection = push.connection.lock()) {
        connection->Withdraw(push.tags.header);
        // An inline tensor has no data write; withdrawing its tag would only crowd the
        // connection's bounded memory of withdrawn tags.
        if (push.has_data_write) connection->Withdraw(push.tags.data);
      }
    }
  }

 protected:
  void RecvFromRemoteAsync(const ParsedKey& parsed, const Rendezvous::Args& args, DoneCallback done) override {
    const std::string peer_task = TaskName(parsed.src);
    if (!Carried(parsed)) {
      grpc_->RecvAsync(parsed, args, std::move(done));
      return;
    }
    std::optional<TensorReceive::FusedSlot> fused;
    if (std::optional<FusedMember> member = ParseFusedMember(parsed.edge_name)) {
      absl::StatusOr<std::shared_ptr<FusedReceive>> message = FusedMessageFrom(peer_task, parsed, *member);
      if (!message.ok()) {
        done(message.status(), Args(), args, Tensor(), false);
        return;
      }
      if (*message) fused = TensorReceive::FusedSlot{*std::move(message), *member};
    }
    auto make = [runtime = runtime_, peer_task, parsed, fused, step_id = step_id_](TensorReceive::Done finished) {
      return std::make_shared<TensorReceive>(runtime, peer_task, std::string(parsed.FullKey()), step_id,
                                             std::string(parsed.edge_name), fused, std::move(finished));
    };
    auto* call = new RdmaRecvCall(std::move(make));
    RegisterCall(call, args);
    if (!call->status().ok()) {
      DeregisterCall(call, args);
      done(call->status(), Args(), args, Tensor(), false);
      delete call;
      return;
    }
    Ref();  // the rendezvous outlives the call
    call->Start([this, call, key = std::string(parsed.FullKey()), peer_task, args, done = std::move(done)] {
      DeregisterCall(call, args);
      ParsedKey reparsed;
      if (!call->status().ok() && runtime_->Renamed(peer_task) && Rendezvous::ParseKey(key, &reparsed).ok()) {
        // The sender's session renamed it, so it serves the tensor over gRPC.
        runtime_->stats().Fallback(kRenamedTask);
        grpc_->RecvAsync(reparsed, args, done);
      } else {
        done(call->status(), Args(), args, call->tensor(), call->dead());
      }
      delete call;
      Unref();
    });
  }

 private:
  // Both ends decide alike, from the key alone: CPU to CPU goes over tf_rdma, anything with a GPU
  // end stays on gRPC (counted).
  bool Carried(const ParsedKey& parsed) {
    if (renamed_) {
      runtime_->stats().Fallback(kRenamedTask);
      return false;
    }
    if (parsed.src.type == "CPU" && parsed.dst.type == "CPU") return true;
    runtime_->stats().Fallback("a GPU end (gRPC copies device memory)");
    return false;
  }

  static constexpr char kRenamedTask[] =
      "a session that renames the tasks (ClusterSpec propagation): a tf_rdma server has one task name";

  void WarnRenamedOnce(const std::string& session_name) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      LOG(WARNING) << "tf_rdma: a session runs this server (task " << runtime_->local_task() << ") as task "
                   << session_name << " (its cluster comes with the session: ClusterSpec propagation); "
                   << "its tensors go over gRPC, counted in tf_rdma.stats()['fallback']. To carry them over "
                   << "tf_rdma, start each server under the job name and index the session's cluster gives it.";
    });
  }

  // A tensor as it travels: its header, and where its bytes come from (its own memory, or its
  // TensorProto for the types whose memory is not their value).
  struct Outgoing {
    TensorHeader header;
    std::shared_ptr<std::string> proto;
    const char* data = nullptr;
  };
  static Outgoing Describe(const Tensor& value, bool is_dead) {
    Outgoing out;
    out.header.dead = is_dead;
    if (is_dead) return out;
    out.header.dtype = value.dtype();
    out.header.shape = value.shape();
    if (TravelsAsBytes(value.dtype())) {
      out.header.data_bytes = value.TotalBytes();
      out.data = value.tensor_data().data();
    } else {
      tensorflow::TensorProto message;
      value.AsProtoTensorContent(&message);
      out.proto = std::make_shared<std::string>(message.SerializeAsString());
      out.header.data_bytes = out.proto->size();
      out.data = out.proto->data();
    }
    return out;
  }

  void Push(const ParsedKey& parsed, const Rendezvous::Args& args, const std::string& peer_task,
            const Tensor& value, bool is_dead) {
    const Outgoing out = Describe(value, is_dead);
    const bool travels_inline = TravelsInline(out.header);
    auto encoded = std::make_shared<std::string>(EncodeHeader(out.header, travels_inline ? out.header.data_bytes : 0));
    // A copy of a few KiB costs less than a second message.
    if (travels_inline && !is_dead) encoded->append(out.data, out.header.data_bytes);
    const TransferTags tags = TagsFor(parsed.FullKey(), step_id_);
    std::vector<Write> writes{{tags.header, encoded->data(), encoded->size()}};
    if (!travels_inline) writes.push_back({tags.data, out.data, out.header.data_bytes});
    const std::string tensor_name(parsed.edge_name);
    WriteTo(peer_task, absl::StrCat("sending '", tensor_name, "' to"), KindOf(tensor_name) == kKindGraph, tags,
            std::move(writes),
            std::make_shared<std::tuple<std::shared_ptr<std::string>, std::shared_ptr<std::string>, Tensor>>(
                encoded, out.proto, value),
            [member = Member{std::string(parsed.FullKey()), args, value, is_dead}](RdmaRemoteRendezvous& step) {
              return step.SendOverGrpc(member);
            },
            [runtime = runtime_, peer_task, tensor_name, bytes = out.header.data_bytes, is_dead] {
              if (!is_dead) CountSent(*runtime, peer_task, tensor_name, bytes);
            });
  }

  // A send, kept for gRPC in case the peer turns out to be renamed.
  struct Member {
    std::string key;
    Rendezvous::Args args;
    Tensor value;
    bool is_dead;
    bool alone = false;  // a fused transfer's tensor that travels on its own
  };
  absl::Status SendOverGrpc(const Member& member) {
    ParsedKey parsed;
    absl::Status status = Rendezvous::ParseKey(member.key, &parsed);
    if (!status.ok()) return status;
    return BaseRemoteRendezvous::Send(parsed, member.args, member.value, member.is_dead);
  }

  static void CountSent(Runtime& runtime, const std::string& peer_task, const std::string& tensor_name,
                        uint64_t bytes) {
    const char* kind = KindOf(tensor_name);
    runtime.stats().Peer(peer_task, [bytes, kind](PeerStats& s) {
      s.tensors_sent++;
      s.bytes_sent += bytes;
      s.bytes_sent_by_kind[kind] += bytes;
    });
  }

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
  void WriteTo(const std::string& peer_task, std::string what, bool fails_step, const TransferTags& tags,
               std::vector<Write> writes, std::shared_ptr<void> keep,
               std::function<absl::Status(RdmaRemoteRendezvous&)> over_grpc, std::function<void()> sent) {
    Ref();
    tsl::core::RefCountPtr<RdmaRemoteRendezvous> self(this);
    auto step = std::make_shared<tsl::core::RefCountPtr<RdmaRemoteRendezvous>>(std::move(self));
    runtime_->WithConnection(peer_task, [runtime = runtime_, step, peer_task, what = std::move(what), fails_step, tags,
                                         writes = std::move(writes), keep = std::move(keep),
                                         over_grpc = std::move(over_grpc), sent = std::move(sent)](
                                            absl::StatusOr<std::shared_ptr<Connection>> connection) {
      auto report = [runtime, step, peer_task, what, fails_step](const absl::Status& status) {
        if (status.ok()) return;
        if (status == DiscardedWrite()) {
          runtime->stats().Peer(peer_task, [](PeerStats& s) { s.sends_discarded++; });
          return;
        }
        LOG(WARNING) << "tf_rdma: " << what << " task " << peer_task << " failed: " << status;
        runtime->stats().Peer(peer_task, [](PeerStats& s) { s.errors++; });
        if (fails_step) (*step)->StartAbort(TaskFailure(what, peer_task, status));
      };
      if (!connection.ok() && runtime->Renamed(peer_task)) {
        // The receiver's session renamed it, so it fetches the tensor over gRPC, from here.
        runtime->stats().Fallback(kRenamedTask);
        return report(over_grpc(**step));
      }
      if (!connection.ok()) return report(connection.status());
      const bool has_data_write = writes.size() > 1;
      const std::optional<uint64_t> push = (*step)->TrackPush(*connection, tags, has_data_write);
      for (const Write& write : writes) {
        (*connection)->Write(write.tag, write.bytes, write.length, [step, push, report, keep](const absl::Status& status) {
          if (push) (*step)->WriteFinished(*push);
          report(status);
        });
      }
      if (!push) {  // the step was aborted before the writes started: nobody will take them
        (*connection)->Withdraw(tags.header);
        if (has_data_write) (*connection)->Withdraw(tags.data);
      }
      sent();
    });
  }

  // A fused transfer's tensor goes into its slot of the step's fused message to its peer, which
  // leaves once every member is in. One that does not fit its slot (it came larger than its static
  // shape planned) travels on its own, its slot saying so.
  absl::Status SendFused(const ParsedKey& parsed, const Rendezvous::Args& args, const std::string& peer_task,
                         const Tensor& value, bool is_dead, const FusedMember& member) {
    std::shared_ptr<FusedSend> message;
    {
      std::lock_guard<std::mutex> lock(pushes_mu_);
      if (!stopped_.ok()) return stopped_;  // the step is over: nobody takes it
      std::shared_ptr<FusedSend>& entry = fused_sends_[member.group];
      if (!entry) entry = std::make_shared<FusedSend>(member);
      message = entry;
      if (message->total != member.total || message->members.size() != member.count) {
        return absl::InternalError(absl::StrCat("tf_rdma: '", parsed.edge_name,
                                                "' does not fit the plan of its fused message"));
      }
      if (message->members[member.index]) return TwiceInOneStep(parsed.edge_name);
      message->members[member.index] = Member{std::string(parsed.FullKey()), args, value, is_dead};
    }
    const Outgoing out = Describe(value, is_dead);
    const bool fits = FillFusedSlot(message->bytes.get() + member.offset, member.capacity, out.header, out.data);
    if (!fits) Push(parsed, args, peer_task, value, is_dead);
    {
      std::lock_guard<std::mutex> lock(pushes_mu_);
      if (fits) {
        message->tensors_in_message++;
        message->bytes_in_message += out.header.data_bytes;
      } else {
        message->members[member.index]->alone = true;
      }
      if (++message->filled < member.count) return absl::OkStatus();
      auto it = fused_sends_.find(member.group);
      if (it != fused_sends_.end() && it->second == message) fused_sends_.erase(it);
    }
    const Tag tag = FusedTag(member.group, step_id_, parsed.src_device, parsed.dst_device);
    WriteTo(peer_task, absl::StrCat("sending a fused message of ", member.count, " tensors to"), true, TransferTags{tag, tag},
            {{tag, message->bytes.get(), message->total}}, message,
            [message](RdmaRemoteRendezvous& step) {
              for (const std::optional<Member>& sent : message->members) {
                if (sent->alone) continue;  // its own push falls back alike
                absl::Status status = step.SendOverGrpc(*sent);
                if (!status.ok()) return status;
              }
              return absl::OkStatus();
            },
            // Counted once per message, not per tensor: the stats' lock is taken per message.
            [runtime = runtime_, peer_task, message] {
              runtime->stats().Peer(peer_task, [&message](PeerStats& s) {
                s.fused_messages_sent++;
                s.tensors_sent += message->tensors_in_message;
                s.bytes_sent += message->bytes_in_message;
                s.bytes_sent_by_kind[kKindGraph] += message->bytes_in_message;
              });
            });
    return absl::OkStatus();
  }

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
                                                                 const ParsedKey& parsed, const FusedMember& member) {
    std::lock_guard<std::mutex> lock(pushes_mu_);
    if (!stopped_.ok()) return nullptr;
    AwaitedMessage& awaited = fused_receives_[member.group];
    if (!awaited.message) {
      awaited.message = std::make_shared<FusedReceive>(
          runtime_, peer_task, FusedTag(member.group, step_id_, parsed.src_device, parsed.dst_device), member);
      awaited.members.assign(member.count, false);
      step_fused_receives_.push_back(awaited.message);
    }
    if (awaited.members.size() != member.count || awaited.members[member.index]) {
      return TwiceInOneStep(parsed.edge_name);
    }
    awaited.members[member.index] = true;
    std::shared_ptr<FusedReceive> message = awaited.message;
    if (++awaited.attached == member.count) fused_receives_.erase(member.group);
    return message;
  }

  // The same fused transfer again before its message was complete: two runs of one graph overlap
  // within a step, and their members could not be told apart.
  static absl::Status TwiceInOneStep(std::string_view tensor_name) {
    return absl::InternalError(absl::StrCat(
        "tf_rdma: '", tensor_name, "' crossed twice within one step before its fused message was complete "
        "(two runs of one graph overlapping in a step); such graphs cannot be fused"));
  }

  // The sends of this step whose writes have not all finished, so an aborted step can withdraw
  // them: the receiver's step is aborted too, and a receive it never issued would never discard
  // them (its Recv had not run yet, e.g. a later iteration of a loop), leaving the tensor held by
  // the connection until it closes. Returns the push's id, or nothing if the step was aborted.
  absl::Status Stopped() {
    std::lock_guard<std::mutex> lock(pushes_mu_);
    return stopped_;
  }

  std::optional<uint64_t> TrackPush(const std::shared_ptr<Connection>& connection, const TransferTags& tags,
                                    bool has_data_write) {
    std::lock_guard<std::mutex> lock(pushes_mu_);
    if (!stopped_.ok()) return std::nullopt;
    const uint64_t id = next_push_++;
    pending_pushes_.emplace(id, PendingPush{connection, tags, has_data_write, has_data_write ? 2 : 1});
    return id;
  }
  void WriteFinished(uint64_t push) {
    std::lock_guard<std::mutex> lock(pushes_mu_);
    auto it = pending_pushes_.find(push);
    if (it != pending_pushes_.end() && --it->second.writes_left == 0) pending_pushes_.erase(it);
  }
  struct PendingPush {
    std::weak_ptr<Connection> connection;  // a closed connection has failed the writes already
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

}  // namespace

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
class RdmaRendezvousMgr::EndedSteps : public std::enable_shared_from_this<EndedSteps> {
 public:
  // Runs under the cache's lock, which the destruction of a rendezvous takes: must not drop a
  // reference to one.
  void Started(int64_t step_id, RdmaRemoteRendezvous* rendezvous) {
    // A rendezvous that goes while its step is listed (nobody cleans the step up: eager steps, a
    // dead owner) takes its entry along. The notice comes on the thread that drops the last
    // reference, which is never done under mu_ (see TakeOverdue).
    auto forget = [steps = weak_from_this(), step_id, rendezvous] {
      if (std::shared_ptr<EndedSteps> alive = steps.lock()) alive->Forget(step_id, rendezvous);
    };
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert_or_assign(step_id, Live{tsl::core::WeakPtr<RdmaRemoteRendezvous>(rendezvous, forget), rendezvous});
  }

  // Returns whether the step's abort waits: its rendezvous is still held, and not because it failed
  // (TensorFlow holds those for good; the base cleanup applies to them).
  bool Ended(int64_t step_id) {
    tsl::core::RefCountPtr<RdmaRemoteRendezvous> rendezvous;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(step_id);
      if (it == live_.end()) return false;
      rendezvous = it->second.rendezvous.GetNewRef();
      live_.erase(it);
    }
    if (!rendezvous || rendezvous->End()) return false;
    tsl::core::WeakPtr<RdmaRemoteRendezvous> weak(rendezvous.get());
    rendezvous.reset();  // maybe the last reference: outside mu_
    if (weak.GetNewRef() == nullptr) return false;
    std::lock_guard<std::mutex> lock(mu_);
    held_.push_back(Held{step_id, std::move(weak), std::chrono::steady_clock::now() + kGrace});
    return true;
  }

  // The ended steps whose rendezvous is still held after kGrace.
  std::vector<int64_t> TakeOverdue() {
    std::vector<int64_t> overdue;
    std::vector<tsl::core::RefCountPtr<RdmaRemoteRendezvous>> released_outside_lock;
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    while (!held_.empty()) {
      tsl::core::RefCountPtr<RdmaRemoteRendezvous> rendezvous = held_.front().rendezvous.GetNewRef();
      const bool alive = rendezvous != nullptr;
      released_outside_lock.push_back(std::move(rendezvous));
      if (alive && held_.front().deadline > now) break;
      if (alive) overdue.push_back(held_.front().step_id);
      held_.pop_front();
    }
    return overdue;
  }

  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    live_.clear();
    held_.clear();
  }

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

  void Forget(int64_t step_id, const RdmaRemoteRendezvous* gone) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(step_id);
    if (it != live_.end() && it->second.identity == gone) live_.erase(it);
  }

  std::mutex mu_;
  absl::flat_hash_map<int64_t, Live> live_;
  std::deque<Held> held_;  // in the order the steps ended, so deadlines ascend
};

RdmaRendezvousMgr::RdmaRendezvousMgr(const tensorflow::WorkerEnv* env, std::shared_ptr<Runtime> runtime)
    : RpcRendezvousMgr(env), runtime_(std::move(runtime)), steps_(std::make_shared<EndedSteps>()) {}

RdmaRendezvousMgr::~RdmaRendezvousMgr() = default;

void RdmaRendezvousMgr::Cleanup(int64_t step_id) {
  // For a step no longer held the base cleanup only drops its cache entry.
  if (!steps_->Ended(step_id)) RpcRendezvousMgr::Cleanup(step_id);
  for (int64_t overdue : steps_->TakeOverdue()) RpcRendezvousMgr::Cleanup(overdue);
}

void RdmaRendezvousMgr::CleanupAll() {
  steps_->Clear();
  RpcRendezvousMgr::CleanupAll();
}

tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> RdmaRendezvousMgr::Create(
    int64_t step_id, const tensorflow::WorkerEnv* worker_env) {
  auto* rendezvous =
      new RdmaRemoteRendezvous(worker_env, step_id, runtime_, RpcRendezvousMgr::Create(step_id, worker_env));
  steps_->Started(step_id, rendezvous);
  return tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous>(rendezvous);
}

}  // namespace tf_rdma
