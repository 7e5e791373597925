#include "cc/tf/calls/call_channel.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

constexpr uint64_t kFirstReplyBytes = 4 << 10;

}  // namespace

// ---- serving side ----

const std::string& ServedCall::peer_name() const { return server_->connection_->peer_name(); }

void ServedCall::SetCancelCallback(std::function<void()> cancel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (replied_) return;
    if (!cancelled_) {
      cancel_ = std::move(cancel);
      return;
    }
  }
  cancel();
}

void ServedCall::Cancel() {
  std::function<void()> cancel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_ || replied_) return;
    cancelled_ = true;
    std::swap(cancel, cancel_);
  }
  if (cancel) cancel();
}

void ServedCall::Reply(const absl::Status& status, std::string_view payload) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (replied_) return;
    replied_ = true;
    cancel_ = nullptr;
  }
  server_->SendReply(call_id_, status, payload);
}

absl::Status CallServer::Start(std::shared_ptr<Connection> connection, Transport& transport,
                               std::shared_ptr<BufferPool> pool, CallLimits limits, ServeCall serve) {
  absl::StatusOr<std::shared_ptr<MemoryRegion>> slots = transport.AllocateRegion(kRequestSlots * kCallRequestSlotBytes);
  if (!slots.ok()) {
    return absl::Status(slots.status().code(), absl::StrCat("the request slots for calls from ",
                                                            connection->peer_name(), ": ", slots.status().message()));
  }
  auto server = std::make_shared<CallServer>(std::move(connection), *std::move(slots), std::move(pool), limits,
                                             std::move(serve));
  for (int slot = 0; slot < kRequestSlots; ++slot) server->GrantSlot(slot);
  return absl::OkStatus();
}

void CallServer::GrantSlot(int slot) {
  connection_->Grant(CallRequestTag(), slots_, slot * kCallRequestSlotBytes, kCallRequestSlotBytes,
                     [server = shared_from_this(), slot](const GrantResult& result) { server->OnRequest(slot, result); });
}

void CallServer::OnRequest(int slot, const GrantResult& result) {
  if (result.status.code() == absl::StatusCode::kResourceExhausted) {
    Refuse(absl::DataLossError(absl::StrCat("a call message of ", result.length, " bytes, more than a request slot's ",
                                            kCallRequestSlotBytes)));
    return;
  }
  if (!result.status.ok()) {
    End();
    return;
  }
  std::string_view inline_payload;
  absl::StatusOr<CallRequestHeader> header =
      DecodeCallRequest(slots_->data() + slot * kCallRequestSlotBytes, result.length, &inline_payload);
  if (!header.ok()) {
    Refuse(header.status());
    return;
  }
  // The payload leaves the slot before the slot is granted again.
  std::string request(inline_payload);
  GrantSlot(slot);
  if (header->frame == CallFrame::kCancel) {
    std::shared_ptr<ServedCall> call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = calls_.find(header->call_id);
      if (it != calls_.end()) call = it->second.call;
    }
    // A call not found has ended (its reply crossed the cancellation).
    if (call) call->Cancel();
    return;
  }
  OnCallRequest(*header, std::move(request));
}

void CallServer::OnCallRequest(const CallRequestHeader& header, std::string inline_payload) {
  const bool travels_inline = CallPayloadTravelsInline(header.payload_bytes);
  const uint64_t body_bytes = travels_inline ? 0 : header.payload_bytes;
  enum class Admission { kAdmitted, kDuplicate, kTooMany, kTooLarge, kEnded } admission;
  uint64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held = body_bytes_;
    if (ended_) {
      admission = Admission::kEnded;
    } else if (calls_.count(header.call_id) != 0) {
      admission = Admission::kDuplicate;
    } else if (calls_.size() >= limits_.max_calls_in_flight) {
      admission = Admission::kTooMany;
    } else if (body_bytes > limits_.max_payload_bytes - body_bytes_) {
      admission = Admission::kTooLarge;
    } else {
      calls_.emplace(header.call_id, Admitted{nullptr, body_bytes});
      body_bytes_ += body_bytes;
      admission = Admission::kAdmitted;
    }
  }
  switch (admission) {
    case Admission::kEnded:
      return;
    case Admission::kDuplicate:
      Refuse(absl::DataLossError(absl::StrCat("call ", header.call_id, " was made again while in flight")));
      return;
    case Admission::kTooMany:
      Decline(header.call_id, absl::ResourceExhaustedError(absl::StrCat(
                                  "task ", connection_->peer_name(), " has ", limits_.max_calls_in_flight,
                                  " calls in flight at its peer, the limit TF_RDMA_MAX_CALLS_PER_PEER sets there")));
      return;
    case Admission::kTooLarge:
      Decline(header.call_id,
              absl::ResourceExhaustedError(absl::StrCat(
                  "a call request of ", header.payload_bytes, " bytes to a task where the requests of task ",
                  connection_->peer_name(), " in flight hold ", held, " bytes already: more than the ",
                  limits_.max_payload_bytes, " TF_RDMA_MAX_CALL_BYTES allows there")));
      return;
    case Admission::kAdmitted:
      break;
  }
  if (travels_inline) {
    Serve(header.method, header.call_id, std::move(inline_payload));
    return;
  }
  absl::StatusOr<std::unique_ptr<PoolBuffer>> body = pool_->Allocate(header.payload_bytes);
  if (!body.ok()) {
    SendReply(header.call_id, body.status(), {});
    return;
  }
  std::shared_ptr<PoolBuffer> held_body(*std::move(body));
  connection_->Grant(CallBodyTag(header.call_id), held_body->region(), held_body->offset(), held_body->capacity(),
                     [server = shared_from_this(), held_body, header](const GrantResult& result) {
                       server->OnBody(header, result, *held_body);
                     });
}

void CallServer::OnBody(const CallRequestHeader& header, const GrantResult& result, const PoolBuffer& body) {
  if (result.status.ok() && result.length == header.payload_bytes) {
    Serve(header.method, header.call_id, std::string(body.data(), result.length));
    return;
  }
  if (result.status.ok() || absl::IsResourceExhausted(result.status)) {
    Refuse(absl::DataLossError(absl::StrCat("call ", header.call_id, "'s request came as ", result.length,
                                            " bytes; its header said ", header.payload_bytes)));
    return;
  }
  // The caller gave the call up (it withdrew the body), or the connection ended (End cancels).
  Forget(header.call_id);
}

void CallServer::Serve(uint8_t method, uint64_t call_id, std::string request) {
  auto call = std::make_shared<ServedCall>(shared_from_this(), method, call_id, std::move(request));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(call_id);
    if (ended_ || it == calls_.end()) return;
    it->second.call = call;
  }
  serve_(std::move(call));
}

void CallServer::SendReply(uint64_t call_id, const absl::Status& status, std::string_view payload) {
  auto message = std::make_shared<const std::string>(EncodeCallReply(status, payload));
  connection_->Write(CallReplyTag(call_id), message->data(), message->size(),
                     [server = shared_from_this(), message, call_id](const absl::Status&) { server->Forget(call_id); });
}

void CallServer::Decline(uint64_t call_id, const absl::Status& why) {
  bool unread_past_limit;
  {
    std::lock_guard<std::mutex> lock(mu_);
    unread_past_limit = declines_unread_ >= limits_.max_calls_in_flight;
    if (!unread_past_limit) ++declines_unread_;
  }
  if (unread_past_limit) {
    // Each waits for the caller's grant: a caller that grants none would have them pile up here.
    Refuse(absl::ResourceExhaustedError(absl::StrCat("it left ", limits_.max_calls_in_flight,
                                                     " answers to calls this task declined unread (",
                                                     why.message(), ")")));
    return;
  }
  auto message = std::make_shared<const std::string>(EncodeCallReply(why, {}));
  connection_->Write(CallReplyTag(call_id), message->data(), message->size(),
                     [server = shared_from_this(), message](const absl::Status&) {
                       std::lock_guard<std::mutex> lock(server->mu_);
                       --server->declines_unread_;
                     });
}

void CallServer::Forget(uint64_t call_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(call_id);
  if (it == calls_.end()) return;
  body_bytes_ -= it->second.body_bytes;
  calls_.erase(it);
}

void CallServer::Refuse(const absl::Status& why) {
  connection_->Close(absl::DataLossError(absl::StrCat("peer ", connection_->peer_name(),
                                                      " broke the tf_rdma protocol: ", why.message())));
}

void CallServer::End() {
  std::unordered_map<uint64_t, Admitted> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return;
    ended_ = true;
    std::swap(calls, calls_);
    body_bytes_ = 0;
  }
  for (auto& [id, admitted] : calls) {
    if (admitted.call) admitted.call->Cancel();
  }
}

// ---- calling side ----

std::shared_ptr<OutgoingCall> CallClient::Call(uint8_t method, std::string request, OutgoingCall::ReplyDone done) {
  auto call = std::make_shared<OutgoingCall>(shared_from_this(), method, next_call_id_++, std::move(done));
  if (request.size() > limits_.max_payload_bytes) {
    call->Finish(absl::ResourceExhaustedError(absl::StrCat("a call to ", connection_->peer_name(), " of ",
                                                           request.size(), " bytes, more than the ",
                                                           limits_.max_payload_bytes, " TF_RDMA_MAX_CALL_BYTES allows")),
                 {});
    return call;
  }
  call->GrantReply(FirstReplyBytes(method));
  call->Send(std::move(request));
  return call;
}

absl::Status CallClient::Unreachable(const absl::Status& cause) const {
  return absl::UnavailableError(absl::StrCat("the call to ", connection_->peer_name(),
                                             " ended without its reply: ", cause.message()));
}

uint64_t CallClient::FirstReplyBytes(uint8_t method) const {
  return std::max(kFirstReplyBytes, reply_bytes_[method].load(std::memory_order_relaxed));
}

void CallClient::LearnReplyBytes(uint8_t method, uint64_t bytes) {
  uint64_t known = reply_bytes_[method].load(std::memory_order_relaxed);
  while (bytes > known && !reply_bytes_[method].compare_exchange_weak(known, bytes, std::memory_order_relaxed)) {
  }
}

void OutgoingCall::Send(std::string request) {
  const bool travels_inline = CallPayloadTravelsInline(request.size());
  const CallRequestHeader header{CallFrame::kRequest, method_, call_id_, request.size()};
  auto message = std::make_shared<const std::string>(
      EncodeCallRequest(header, travels_inline ? std::string_view(request) : std::string_view()));
  Connection& connection = *client_->connection_;
  if (!travels_inline) {
    std::lock_guard<std::mutex> lock(mu_);
    body_sent_ = true;
  }
  connection.Write(CallRequestTag(), message->data(), message->size(),
                   [call = shared_from_this(), message](const absl::Status& status) { call->OnWritten(status); });
  if (travels_inline) return;
  auto body = std::make_shared<const std::string>(std::move(request));
  connection.Write(CallBodyTag(call_id_), body->data(), body->size(),
                   [call = shared_from_this(), body](const absl::Status& status) { call->OnWritten(status); });
}

void OutgoingCall::OnWritten(const absl::Status& status) {
  // A write the call withdrew completes with kCancelled after Finish: then this does nothing.
  if (!status.ok()) Finish(client_->Unreachable(status), {});
}

void OutgoingCall::GrantReply(uint64_t capacity) {
  absl::StatusOr<std::unique_ptr<PoolBuffer>> buffer = client_->pool_->Allocate(capacity);
  if (!buffer.ok()) {
    Finish(absl::Status(buffer.status().code(), absl::StrCat("memory for the reply of a call to ",
                                                             client_->connection_->peer_name(), ": ",
                                                             buffer.status().message())),
           {});
    return;
  }
  std::shared_ptr<PoolBuffer> held(*std::move(buffer));
  Connection& connection = *client_->connection_;
  const uint64_t grant = connection.Grant(
      CallReplyTag(call_id_), held->region(), held->offset(), held->capacity(),
      [call = shared_from_this(), held](const GrantResult& result) { call->OnReply(result, *held); });
  bool finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished = !done_;
    reply_grant_ = grant;
  }
  // Cancelled while the grant was made: Cancel found no grant to take back.
  if (finished) connection.Revoke(grant);
}

void OutgoingCall::OnReply(const GrantResult& result, const PoolBuffer& buffer) {
  if (absl::IsResourceExhausted(result.status)) {
    if (result.length > client_->limits_.max_payload_bytes + kCallRequestSlotBytes) {
      client_->connection_->DiscardPeerWrites(CallReplyTag(call_id_));
      Finish(absl::ResourceExhaustedError(absl::StrCat("the reply from ", client_->connection_->peer_name(), " is ",
                                                       result.length, " bytes, more than the ",
                                                       client_->limits_.max_payload_bytes,
                                                       " TF_RDMA_MAX_CALL_BYTES allows")),
             {});
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!done_) return;
    }
    GrantReply(result.length);
    return;
  }
  if (!result.status.ok()) {
    Finish(client_->Unreachable(result.status), {});  // nothing when this call's own Cancel revoked it
    return;
  }
  absl::StatusOr<CallReply> reply = DecodeCallReply(buffer.data(), result.length);
  if (!reply.ok()) {
    const absl::Status broken = absl::DataLossError(absl::StrCat(
        "peer ", client_->connection_->peer_name(), " broke the tf_rdma protocol: ", reply.status().message()));
    client_->connection_->Close(broken);
    Finish(client_->Unreachable(broken), {});
    return;
  }
  client_->LearnReplyBytes(method_, result.length);
  Finish(reply->status, reply->payload);
}

bool OutgoingCall::Finish(const absl::Status& status, std::string_view reply) {
  ReplyDone done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) return false;
    std::swap(done, done_);
  }
  done(status, reply);
  return true;
}

void OutgoingCall::Cancel(const absl::Status& why) {
  ReplyDone done;
  uint64_t grant;
  bool body_sent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) return;
    std::swap(done, done_);
    grant = reply_grant_;
    body_sent = body_sent_;
  }
  Connection& connection = *client_->connection_;
  connection.DiscardPeerWrites(CallReplyTag(call_id_));
  if (grant != 0) connection.Revoke(grant);
  if (body_sent) connection.Withdraw(CallBodyTag(call_id_), why);
  auto message = std::make_shared<const std::string>(
      EncodeCallRequest(CallRequestHeader{CallFrame::kCancel, method_, call_id_, 0}, {}));
  connection.Write(CallRequestTag(), message->data(), message->size(), [message](const absl::Status&) {});
  done(why, {});
}

}  // namespace tf_rdma
