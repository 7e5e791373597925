#include "cc/tf/rendezvous/tensor_receive.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/tf/planning/static_sizes.h"
#include "cc/tf/rendezvous/transfer_names.h"
#include "cc/tf/runtime/pool_tensor_buffer.h"
#include "cc/tf/runtime/task_names.h"
#include "cc/transport/peer_errors.h"

namespace tf_rdma {

using tensorflow::Tensor;

void TensorReceive::Start() {
  span_ = TraceSpan::Start();
  if (!fused_) return StartGrants();
  fused_->message->Attach(fused_->member, [self = shared_from_this()](const absl::Status& status,
                                                                       std::string_view message) {
    self->OnFusedSlot(status, message);
  });
}

void TensorReceive::Abort(const absl::Status& status) {
  Locked lock(this);
  FinishLocked(status);
}

void TensorReceive::Finish(const absl::Status& status) {
  Locked lock(this);
  FinishLocked(status);
}

void TensorReceive::StartGrants() {
  {
    Locked lock(this);
    tags_ = TagsFor(key_, step_id_);
    transfer_ = TransferName(key_);
  }
  runtime_->connections().WithConnection(peer_task_, [self = shared_from_this()](
                                                         absl::StatusOr<std::shared_ptr<Connection>> connection) {
    if (!connection.ok()) return self->Finish(connection.status());
    self->Grant(std::move(*connection));
  });
}

void TensorReceive::OnFusedSlot(const absl::Status& status, std::string_view message) {
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

void TensorReceive::Grant(std::shared_ptr<Connection> connection) {
  absl::StatusOr<std::shared_ptr<BufferPool>> pool = runtime_->receive_pools().For(connection);
  Locked lock(this);
  if (finished_) return;
  if (!pool.ok()) return FinishLocked(pool.status());
  connection_ = std::move(connection);
  pool_ = *pool;
  const int attempt = attempt_;
  absl::Status granted = GrantLocked(tags_.header, kHeaderMessageCapacity, true);
  // A grant on a connection that failed meanwhile completes inside Grant: the receive may have
  // finished, or started its next attempt, already.
  if (finished_ || attempt != attempt_) return;
  // A tensor expected small comes inside the header's message; if it turns out larger, its
  // header says so and the data is granted then.
  const uint64_t expected = FirstGrantBytes();
  if (granted.ok() && expected > kInlineBytes) granted = GrantLocked(tags_.data, expected, false);
  if (!granted.ok()) FinishLocked(granted);
}

uint64_t TensorReceive::FirstGrantBytes() {
  const uint64_t learned = runtime_->learned_sizes().Expected(transfer_);
  if (learned != 0) return learned;
  const std::optional<uint64_t> planned = PlannedBytes(transfer_);
  if (!planned) return 0;
  runtime_->stats().ReceivePlanned();
  return *planned;
}

absl::Status TensorReceive::GrantLocked(const Tag& tag, uint64_t capacity, bool is_header) {
  absl::StatusOr<std::unique_ptr<PoolBuffer>> allocated = pool_->Allocate(capacity);
  if (!allocated.ok()) return allocated.status();
  std::shared_ptr<PoolBuffer> buffer = std::move(*allocated);
  uint64_t& id = is_header ? header_grant_ : data_grant_;
  // The buffer stays with the grant's callback until the grant completes, whatever happens to
  // the receive meanwhile: nothing else may use it while the peer may still write it.
  id = connection_->Grant(tag, buffer->region(), buffer->offset(), capacity,
                          [self = shared_from_this(), buffer, is_header, attempt = attempt_](const GrantResult& r) {
                            if (is_header) {
                              self->OnHeader(r, *buffer, attempt);
                            } else {
                              self->OnData(r, buffer, attempt);
                            }
                          });
  runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.grants++; });
  return absl::OkStatus();
}

bool TensorReceive::GrantAgainAfterOwnSilenceLocked(const absl::Status& status) {
  if (!PeerFoundThisProcessSilent(status) || attempt_ != 0 || header_) return false;
  // Nothing came on the connection the peer closed: grant again over the next one, where the
  // sender sends the message again (or, having given it up, says so). The other grant of this
  // attempt fails with the old connection and is ignored as an earlier attempt's.
  ++attempt_;
  connection_.reset();
  pool_.reset();
  header_grant_ = data_grant_ = 0;
  needed_bytes_ = 0;
  StartGrants();
  return true;
}

void TensorReceive::OnHeader(const GrantResult& result, const PoolBuffer& buffer, int attempt) {
  Locked lock(this);
  if (finished_ || attempt != attempt_) return;
  if (GrantAgainAfterOwnSilenceLocked(result.status)) return;
  if (!result.status.ok()) return FinishLocked(result.status);
  OnHeaderMessageLocked(buffer.data(), result.length, /*fused=*/false);
}

void TensorReceive::OnHeaderMessageLocked(const char* message, uint64_t length, bool fused) {
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

void TensorReceive::OnData(const GrantResult& result, std::shared_ptr<PoolBuffer> buffer, int attempt) {
  Locked lock(this);
  if (finished_ || attempt != attempt_) return;
  if (result.status.code() == absl::StatusCode::kResourceExhausted) {
    // The tensor outgrew what this transfer carried before. The size the sender asks for is
    // granted only once its header confirms it: a peer's word alone must not size our memory.
    needed_bytes_ = result.length;
    if (!header_) return;
    absl::Status regranted = RegrantLocked();
    if (!regranted.ok()) FinishLocked(regranted);
    return;
  }
  // The connection's end may reach the data grant before the header's.
  if (GrantAgainAfterOwnSilenceLocked(result.status)) return;
  if (!result.status.ok()) return FinishLocked(result.status);
  data_ = std::move(buffer);
  data_length_ = result.length;
  EndRegrantSpanLocked();
  MaybeOutputLocked();
}

absl::Status TensorReceive::RegrantLocked() {
  const uint64_t needed = needed_bytes_;
  needed_bytes_ = 0;
  if (header_->dead) return absl::OkStatus();  // its data grant is being revoked
  if (needed != header_->data_bytes) {
    return absl::DataLossError(absl::StrCat("the peer asked for ", needed, " bytes but its header announced ",
                                            header_->data_bytes));
  }
  return GrantDataLocked();
}

absl::Status TensorReceive::GrantDataLocked() {
  runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.regrants++; });
  regrant_span_ = TraceSpan::Start();
  return GrantLocked(tags_.data, header_->data_bytes, false);
}

void TensorReceive::MaybeOutputLocked() {
  if (!header_ || !data_) return;
  if (header_->data_bytes != data_length_) {
    return FinishLocked(absl::DataLossError(absl::StrCat(
        "the header announced ", header_->data_bytes, " bytes but ", data_length_, " landed")));
  }
  const char* bytes = data_->data();
  OutputLocked(bytes, std::move(data_));
}

void TensorReceive::OutputLocked(const char* bytes, std::shared_ptr<PoolBuffer> landed) {
  const uint64_t length = header_->data_bytes;
  if (!transfer_.empty()) runtime_->learned_sizes().Learn(transfer_, length);
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

void TensorReceive::FinishLocked(const absl::Status& status) {
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
      connection_->DiscardPeerWrites(tags_.header);
      connection_->DiscardPeerWrites(tags_.data);
    }
  }
  if (!status.ok() && !absl::IsCancelled(status)) {
    runtime_->stats().Peer(peer_task_, [](PeerStats& s) { s.errors++; });
    status_ = TaskFailure(absl::StrCat("receiving '", tensor_name_, "' from"), peer_task_, status);
  }
  EndRegrantSpanLocked();
  span_.End([this] {
    return TransferEvent(fused_ ? "tf_rdma fused member receive" : "tf_rdma receive", peer_task_, BackendOfLocked(),
                         header_ ? header_->data_bytes : 0, step_id_, status_, "tensor", tensor_name_);
  });
  // done_ runs when the outermost Locked lets go; later grant completions only release buffers.
}

const char* TensorReceive::BackendOfLocked() const {
  return connection_ ? BackendName(connection_->backend()) : "none";
}

void TensorReceive::EndRegrantSpanLocked() {
  regrant_span_.End([this] {
    return TransferEvent("tf_rdma regrant", peer_task_, BackendOfLocked(), header_ ? header_->data_bytes : 0,
                         step_id_, status_, "tensor", tensor_name_);
  });
}

}  // namespace tf_rdma
