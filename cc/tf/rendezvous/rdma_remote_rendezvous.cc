#include "cc/tf/rendezvous/rdma_remote_rendezvous.h"

#include <utility>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/rendezvous/rdma_recv_call.h"
#include "cc/tf/rendezvous/tensor_receive.h"
#include "cc/tf/rendezvous/transfer_names.h"

namespace tf_rdma {

using tensorflow::Rendezvous;
using tensorflow::Tensor;

absl::Status RdmaRemoteRendezvous::Initialize(tensorflow::WorkerSession* session) {
  absl::Status status = BaseRemoteRendezvous::Initialize(session);
  if (!status.ok()) return status;
  renamed_ = session->worker_name() != runtime_->local_task();
  if (renamed_) WarnRenamedOnce(session->worker_name());
  return grpc_->Initialize(session);
}

void RdmaRemoteRendezvous::StartAbort(const absl::Status& status) {
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

bool RdmaRemoteRendezvous::End() {
  bool failed;
  {
    std::lock_guard<std::mutex> lock(pushes_mu_);
    if (phase_ == Phase::kRunning) phase_ = Phase::kEnded;
    failed = phase_ == Phase::kFailed;
  }
  WithdrawPendingPushes(absl::CancelledError("the step ended"));
  return failed;
}

void RdmaRemoteRendezvous::RecvFromRemoteAsync(const ParsedKey& parsed, const Rendezvous::Args& args,
                                               DoneCallback done) {
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
    if (!call->status().ok() && runtime_->task_addresses().Renamed(peer_task) &&
        Rendezvous::ParseKey(key, &reparsed).ok()) {
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

bool RdmaRemoteRendezvous::Carried(const ParsedKey& parsed) {
  if (renamed_) {
    runtime_->stats().Fallback(kRenamedTask);
    return false;
  }
  if (parsed.src.type == "CPU" && parsed.dst.type == "CPU") return true;
  runtime_->stats().Fallback("a GPU end (gRPC copies device memory)");
  return false;
}

void RdmaRemoteRendezvous::WarnRenamedOnce(const std::string& session_name) {
  static std::once_flag warned;
  std::call_once(warned, [&] {
    LOG(WARNING) << "tf_rdma: a session runs this server (task " << runtime_->local_task() << ") as task "
                 << session_name << " (its cluster comes with the session: ClusterSpec propagation); "
                 << "its tensors go over gRPC, counted in tf_rdma.stats()['fallback']. To carry them over "
                 << "tf_rdma, start each server under the job name and index the session's cluster gives it.";
  });
}

absl::StatusOr<std::shared_ptr<FusedReceive>> RdmaRemoteRendezvous::FusedMessageFrom(
    const std::string& peer_task, const ParsedKey& parsed, const FusedMember& member) {
  std::lock_guard<std::mutex> lock(pushes_mu_);
  if (!stopped_.ok()) return nullptr;
  AwaitedMessage& awaited = fused_receives_[member.group];
  if (!awaited.message) {
    awaited.message = std::make_shared<FusedReceive>(
        runtime_, peer_task, step_id_, FusedTag(member.group, step_id_, parsed.src_device, parsed.dst_device), member);
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

absl::Status RdmaRemoteRendezvous::TwiceInOneStep(std::string_view tensor_name) {
  return absl::InternalError(absl::StrCat(
      "tf_rdma: '", tensor_name, "' crossed twice within one step before its fused message was complete "
      "(two runs of one graph overlapping in a step); such graphs cannot be fused"));
}

absl::Status RdmaRemoteRendezvous::Stopped() {
  std::lock_guard<std::mutex> lock(pushes_mu_);
  return stopped_;
}

}  // namespace tf_rdma
