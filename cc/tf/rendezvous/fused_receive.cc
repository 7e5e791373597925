#include "cc/tf/rendezvous/fused_receive.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/tf/runtime/task_names.h"

namespace tf_rdma {

FusedReceive::FusedReceive(std::shared_ptr<Runtime> runtime, std::string peer_task, int64_t step_id, Tag tag,
                           const FusedMember& plan)
    : runtime_(std::move(runtime)), peer_task_(std::move(peer_task)), step_id_(step_id), tag_(tag),
      total_(plan.total), count_(plan.count) {}

void FusedReceive::Attach(const FusedMember& member, Deliver deliver) {
  std::unique_lock<std::recursive_mutex> lock(mu_);
  absl::Status refused = failure_;
  if (refused.ok() && (member.total != total_ || member.count != count_)) {
    refused = absl::InternalError(absl::StrCat("tf_rdma: a member of fused message ", member.group, " planned ",
                                               member.count, " members in ", member.total, " bytes, another ",
                                               count_, " in ", total_));
  }
  if (!refused.ok()) {
    lock.unlock();
    deliver(refused, {});
    return;
  }
  Waiting waiting{member, std::move(deliver)};
  if (landed_) {
    std::shared_ptr<PoolBuffer> buffer = landed_;
    HandedOutLocked(1);
    lock.unlock();
    DeliverSlot(*buffer, waiting, peer_task_);
    return;
  }
  waiting_.push_back(std::move(waiting));
  if (started_) return;
  started_ = true;
  span_ = TraceSpan::Start();
  lock.unlock();
  runtime_->connections().WithConnection(peer_task_, [self = shared_from_this()](
                                                         absl::StatusOr<std::shared_ptr<Connection>> connection) {
    if (!connection.ok()) return self->Fail(connection.status());
    self->Grant(std::move(*connection));
  });
}

void FusedReceive::Grant(std::shared_ptr<Connection> connection) {
  absl::StatusOr<std::shared_ptr<BufferPool>> pool = runtime_->receive_pools().For(connection);
  if (!pool.ok()) return Fail(pool.status());
  absl::StatusOr<std::unique_ptr<PoolBuffer>> allocated = (*pool)->Allocate(total_);
  if (!allocated.ok()) return Fail(allocated.status());
  std::shared_ptr<PoolBuffer> buffer = std::move(*allocated);
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (!failure_.ok()) return;  // aborted meanwhile
  connection_ = std::move(connection);
  // The buffer stays with the grant's callback until the grant completes: nothing else may use it
  // while the peer may still write it.
  grant_id_ = connection_->Grant(tag_, buffer->region(), buffer->offset(), total_,
                                 [self = shared_from_this(), buffer](const GrantResult& result) {
                                   self->OnLanded(result, buffer);
                                 });
  runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.grants++; });
}

void FusedReceive::OnLanded(const GrantResult& result, const std::shared_ptr<PoolBuffer>& buffer) {
  std::vector<Waiting> ready;
  absl::Status outcome;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!failure_.ok() || landed_) return;
    absl::Status status = result.status;
    if (status.ok() && result.length != total_) {
      status = absl::DataLossError(absl::StrCat("a fused message of ", result.length, " bytes landed, planned ", total_));
    } else if (absl::IsResourceExhausted(status)) {
      // Both ends planned the same layout: a peer that needs more is not following it.
      status = absl::DataLossError(absl::StrCat("the peer's fused message needs ", result.length,
                                                " bytes, planned ", total_));
    }
    if (!status.ok()) {
      failure_ = absl::IsCancelled(status)
                     ? status
                     : TaskFailure("receiving a fused message from", peer_task_, status);
      if (!absl::IsCancelled(status)) runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.errors++; });
    } else {
      landed_ = buffer;
      runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.fused_messages_received++; });
    }
    outcome = failure_;
    EndSpanLocked(outcome);
    ready.swap(waiting_);
    if (landed_) HandedOutLocked(ready.size());
  }
  for (const Waiting& waiting : ready) {
    if (outcome.ok()) {
      DeliverSlot(*buffer, waiting, peer_task_);
    } else {
      waiting.deliver(outcome, {});
    }
  }
}

void FusedReceive::Fail(const absl::Status& cause) {
  std::vector<Waiting> failed;
  absl::Status status;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!failure_.ok()) return;
    failure_ = TaskFailure("receiving a fused message from", peer_task_, cause);
    status = failure_;
    EndSpanLocked(status);
    failed.swap(waiting_);
  }
  runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.errors++; });
  for (const Waiting& waiting : failed) waiting.deliver(status, {});
}

void FusedReceive::Abort(const absl::Status& status) {
  std::vector<Waiting> failed;
  const absl::Status reason = status.ok() ? absl::CancelledError("the step ended") : status;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!failure_.ok()) return;
    failure_ = reason;
    EndSpanLocked(reason);
    if (!landed_ && connection_) {
      connection_->Revoke(grant_id_);
      // Without this the sender would keep the message until the connection closes.
      connection_->DiscardPeerWrites(tag_);
    }
    landed_.reset();
    failed.swap(waiting_);
  }
  for (const Waiting& waiting : failed) waiting.deliver(reason, {});
}

void FusedReceive::EndSpanLocked(const absl::Status& outcome) {
  span_.End([this, &outcome] {
    return TransferEvent("tf_rdma fused receive", peer_task_,
                         connection_ ? BackendName(connection_->backend()) : "none", total_, step_id_, outcome,
                         "tensors", count_);
  });
}

void FusedReceive::HandedOutLocked(size_t members) {
  handed_out_ += members;
  if (handed_out_ >= count_) landed_.reset();
}

void FusedReceive::DeliverSlot(const PoolBuffer& buffer, const Waiting& waiting, const std::string& peer_task) {
  absl::StatusOr<std::string_view> message =
      ReadFusedSlot(buffer.data() + waiting.member.offset, waiting.member.capacity);
  if (!message.ok()) {
    waiting.deliver(TaskFailure("receiving a fused message from", peer_task, message.status()), {});
  } else {
    waiting.deliver(absl::OkStatus(), *message);
  }
}

}  // namespace tf_rdma
