// The send path of a step's remote rendezvous: a tensor written into the range its receiver
// granted (Push), or into its slot of the step's fused message to that peer (SendFused); the
// writes tracked as pending pushes until they finish, so the step's abort or end withdraws them.
#include "cc/tf/rendezvous/rdma_remote_rendezvous.h"

#include <tuple>
#include <utility>

#include "absl/log/log.h"
#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cc/tf/profiling/trace_span.h"
#include "cc/tf/rendezvous/transfer_names.h"
#include "cc/tf/runtime/task_names.h"
#include "cc/transport/peer_errors.h"
#include "tensorflow/core/framework/tensor.pb.h"

namespace tf_rdma {

using tensorflow::Rendezvous;
using tensorflow::Tensor;

namespace {

// TensorFlow's executor turns an UnavailableError from an op that is not a communication op into
// an InternalError (errors::ReplaceErrorFromNonCommunicationOps), and _Send is not one (_Recv is).
// ParameterServerStrategy's coordinator takes an InternalError for the program's own fault and
// stops, where it retries a worker's Unavailable or Aborted. A send that finds its step aborted by
// a peer's failure therefore reports it as Aborted, with the same text and payloads.
std::vector<Tag> TagsWritten(const TransferTags& tags, bool has_data_write) {
  if (has_data_write) return {tags.header, tags.data};
  return {tags.header};
}

absl::Status AsSendError(absl::Status status) {
  if (!absl::IsUnavailable(status)) return status;
  absl::Status aborted = absl::AbortedError(status.message());
  status.ForEachPayload(
      [&aborted](absl::string_view type_url, const absl::Cord& payload) { aborted.SetPayload(type_url, payload); });
  return aborted;
}

}  // namespace

absl::Status RdmaRemoteRendezvous::Send(const ParsedKey& parsed, const Rendezvous::Args& args, const Tensor& value,
                                        bool is_dead) {
  return AsSendError(SendOrStopped(parsed, args, value, is_dead));
}

absl::Status RdmaRemoteRendezvous::SendOrStopped(const ParsedKey& parsed, const Rendezvous::Args& args,
                                                 const Tensor& value, bool is_dead) {
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

void RdmaRemoteRendezvous::WithdrawPendingPushes(const absl::Status& status) {
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
    // An inline tensor has no data write; withdrawing its tag would only crowd the connection's
    // bounded memory of withdrawn tags.
    const std::vector<Tag> tags = TagsWritten(push.tags, push.has_data_write);
    if (std::shared_ptr<Connection> connection = push.connection.lock()) {
      for (const Tag& tag : tags) connection->Withdraw(tag, status);
    }
    // And the peer's next connection: its receive grants again there after a freeze.
    runtime_->connections().Withdraw(push.peer_task, tags, status);
  }
}

RdmaRemoteRendezvous::Outgoing RdmaRemoteRendezvous::Describe(const Tensor& value, bool is_dead) {
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

void RdmaRemoteRendezvous::Push(const ParsedKey& parsed, const Rendezvous::Args& args, const std::string& peer_task,
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
  WriteTo("tf_rdma send", peer_task, absl::StrCat("sending '", tensor_name, "' to"), KindOf(tensor_name) == kKindGraph,
          tags,
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

absl::Status RdmaRemoteRendezvous::SendOverGrpc(const Member& member) {
  ParsedKey parsed;
  absl::Status status = Rendezvous::ParseKey(member.key, &parsed);
  if (!status.ok()) return status;
  return BaseRemoteRendezvous::Send(parsed, member.args, member.value, member.is_dead);
}

void RdmaRemoteRendezvous::CountSent(Runtime& runtime, const std::string& peer_task, const std::string& tensor_name,
                                     uint64_t bytes) {
  const char* kind = KindOf(tensor_name);
  runtime.stats().Peer(peer_task, [bytes, kind](PeerStats& s) {
    s.tensors_sent++;
    s.bytes_sent += bytes;
    s.bytes_sent_by_kind[kind] += bytes;
  });
}

struct RdmaRemoteRendezvous::MessageInFlight {
  const char* event;
  TraceSpan span;  // from the tensor (or the fused message) ready to its last write done
  std::shared_ptr<Runtime> runtime;
  std::shared_ptr<tsl::core::RefCountPtr<RdmaRemoteRendezvous>> step;
  std::string peer_task;
  std::string what;
  bool fails_step;
  TransferTags tags;
  std::vector<Write> writes;
  std::shared_ptr<void> keep;
  std::function<absl::Status(RdmaRemoteRendezvous&)> over_grpc;
  bool resent = false;
  std::mutex mu;
  size_t writes_left = 0;
  // The writes that failed because this process closed the connection on the peer's silence, held
  // back from Report: when all of them failed so, none of the message reached the peer.
  size_t went_silent = 0;
  absl::Status silence;
  absl::Status failure;  // the first write's that failed, for the message's profiler event

  void Report(const absl::Status& status) const {
    if (status.ok()) return;
    if (status == DiscardedWrite()) {
      runtime->stats().Peer(peer_task, [](PeerStats& s) { s.sends_discarded++; });
      return;
    }
    LOG(WARNING) << "tf_rdma: " << what << " task " << peer_task << " failed: " << status;
    runtime->stats().Peer(peer_task, [](PeerStats& s) { s.errors++; });
    // The message is given up, and no step's withdrawal knows it (it is no longer pending): the
    // peer's receive, should it grant again over a new connection (it was frozen and runs again),
    // learns why instead of waiting.
    runtime->connections().Withdraw(peer_task, TagsWritten(tags, writes.size() > 1), status);
    if (fails_step) (*step)->StartAbort(TaskFailure(what, peer_task, status));
  }
};

void RdmaRemoteRendezvous::WriteTo(const char* event, const std::string& peer_task, std::string what,
                                   bool fails_step, const TransferTags& tags, std::vector<Write> writes, std::shared_ptr<void> keep,
                                   std::function<absl::Status(RdmaRemoteRendezvous&)> over_grpc,
                                   std::function<void()> sent) {
  Ref();
  tsl::core::RefCountPtr<RdmaRemoteRendezvous> self(this);
  auto message = std::make_shared<MessageInFlight>();
  message->event = event;
  message->span = TraceSpan::Start();
  message->runtime = runtime_;
  message->step = std::make_shared<tsl::core::RefCountPtr<RdmaRemoteRendezvous>>(std::move(self));
  message->peer_task = peer_task;
  message->what = std::move(what);
  message->fails_step = fails_step;
  message->tags = tags;
  message->writes = std::move(writes);
  message->keep = std::move(keep);
  message->over_grpc = std::move(over_grpc);
  Deliver(std::move(message), std::move(sent));
}

void RdmaRemoteRendezvous::Deliver(std::shared_ptr<MessageInFlight> message, std::function<void()> sent) {
  Connections& connections = message->runtime->connections();
  connections.WithConnection(message->peer_task, [message, sent = std::move(sent)](
                                                      absl::StatusOr<std::shared_ptr<Connection>> connection) {
    RdmaRemoteRendezvous& step = **message->step;
    if (!connection.ok() && message->runtime->task_addresses().Renamed(message->peer_task)) {
      // The receiver's session renamed it, so it fetches the tensor over gRPC, from here.
      message->runtime->stats().Fallback(kRenamedTask);
      return message->Report(message->over_grpc(step));
    }
    if (!connection.ok()) return message->Report(connection.status());
    const TransferTags& tags = message->tags;
    const bool has_data_write = message->writes.size() > 1;
    const std::optional<uint64_t> push = step.TrackPush(*connection, message->peer_task, tags, has_data_write);
    {
      std::lock_guard<std::mutex> lock(message->mu);
      message->writes_left = message->writes.size();
      message->went_silent = 0;  // a resent message's writes report every failure
      message->silence = absl::OkStatus();
      message->failure = absl::OkStatus();
    }
    for (const Write& write : message->writes) {
      (*connection)->Write(write.tag, write.bytes, write.length, [message, push, backend = (*connection)->backend()](
                                                                    const absl::Status& status) {
        if (push) (*message->step)->WriteFinished(*push);
        const bool held_back = !message->resent && PeerWentSilent(status);
        bool last, all_went_silent;
        absl::Status silence;
        {
          std::lock_guard<std::mutex> lock(message->mu);
          if (held_back && message->went_silent++ == 0) message->silence = status;
          if (!status.ok() && message->failure.ok()) message->failure = status;
          last = --message->writes_left == 0;
          all_went_silent = message->went_silent == message->writes.size();
          if (last) silence = message->silence;
        }
        if (!held_back) message->Report(status);
        if (!last) return;
        // A step that ended or was aborted meanwhile takes no transfer (Send's rule).
        if (all_went_silent && (*message->step)->Stopped().ok()) {
          LOG(WARNING) << "tf_rdma: " << message->what << " task " << message->peer_task
                       << ": its connection ended on the peer's silence before the peer took it; sending it "
                       << "again over a new connection";
          message->runtime->stats().Peer(message->peer_task, [](PeerStats& s) { s.resends++; });
          message->resent = true;  // the last write's callback: no other reads it meanwhile
          return Deliver(message, nullptr);
        }
        message->span.End([&message, backend] {
          uint64_t bytes = 0;
          for (const Write& write : message->writes) bytes += write.length;
          return TransferEvent(message->event, message->peer_task, BackendName(backend), bytes,
                               (*message->step)->step_id_, message->failure, "what", message->what);
        });
        message->Report(silence);
      });
    }
    if (!push) {  // the step was aborted before the writes started: nobody will take them
      const absl::Status stopped = step.Stopped();
      const std::vector<Tag> withdrawn = TagsWritten(tags, has_data_write);
      for (const Tag& tag : withdrawn) (*connection)->Withdraw(tag, stopped);
      message->runtime->connections().Withdraw(message->peer_task, withdrawn, stopped);
    }
    if (sent) sent();
  });
}

absl::Status RdmaRemoteRendezvous::SendFused(const ParsedKey& parsed, const Rendezvous::Args& args,
                                             const std::string& peer_task, const Tensor& value, bool is_dead,
                                             const FusedMember& member) {
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
  WriteTo("tf_rdma fused send", peer_task, absl::StrCat("sending a fused message of ", member.count, " tensors to"),
          true, TransferTags{tag, tag},
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

std::optional<uint64_t> RdmaRemoteRendezvous::TrackPush(const std::shared_ptr<Connection>& connection,
                                                        const std::string& peer_task, const TransferTags& tags,
                                                        bool has_data_write) {
  std::lock_guard<std::mutex> lock(pushes_mu_);
  if (!stopped_.ok()) return std::nullopt;
  const uint64_t id = next_push_++;
  pending_pushes_.emplace(id, PendingPush{connection, peer_task, tags, has_data_write, has_data_write ? 2 : 1});
  return id;
}

void RdmaRemoteRendezvous::WriteFinished(uint64_t push) {
  std::lock_guard<std::mutex> lock(pushes_mu_);
  auto it = pending_pushes_.find(push);
  if (it != pending_pushes_.end() && --it->second.writes_left == 0) pending_pushes_.erase(it);
}

}  // namespace tf_rdma
