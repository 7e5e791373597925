// The connection's progress on its I/O loop's thread: completions (ibv_poll_cq(3)), rdma_cm events,
// heartbeats, and what the peer's messages and writes mean for the grant book.
#include "cc/transport/verbs/verbs_connection.h"

#include <arpa/inet.h>
#include <sys/epoll.h>

#include <algorithm>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/peer_errors.h"

namespace tf_rdma::verbs {
namespace {

// Completion batches one call of the loop handles at most, so that one connection's stream of
// completions cannot starve the loop's other connections.
constexpr int kPollBatchSize = 32;
constexpr int kPollBatches = 16;

// The peer learns why we end the connection when the cause is its protocol error.
std::optional<absl::Status> ToldIfProtocolError(const absl::Status& failure) {
  if (failure.code() != absl::StatusCode::kDataLoss) return std::nullopt;
  return failure;
}

}  // namespace

IoHandler::Progress VerbsConnection::OnEvents(uint32_t) {
  std::vector<std::function<void()>> callbacks;
  // The completion queue first: in a busy exchange its next completion is usually there already.
  bool more = PollCompletions(&callbacks);
  epoll_event ready[3];
  const int count = epoll_wait(queue_pair_.epoll_fd(), ready, 3, 0);
  bool cm_events = false;
  for (int i = 0; i < count; ++i) {
    if (ready[i].data.fd == queue_pair_.completion_fd()) {
      // Re-armed, then polled: a completion that came meanwhile is taken now, a later one raises
      // the next event.
      if (queue_pair_.TakeCompletionEvent()) more |= PollCompletions(&callbacks);
    } else if (ready[i].data.fd == queue_pair_.events()->fd) {
      cm_events = true;
    } else {
      queue_pair_.TakeWakes();
    }
  }
  if (cm_events) HandleCmEvents(&callbacks);
  bool finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DrainInboxLocked(&callbacks);
    finished = SettleCloseLocked(absl::Now(), &callbacks);
    TakeLoopCallbacksLocked(&callbacks);
  }
  for (auto& callback : callbacks) callback();
  if (finished) return Progress::kFinished;
  // Sleeping on the completion channel costs a thread wakeup per message, which dominates
  // small-message latency: for TF_RDMA_VERBS_POLL_US after the last completion the loop comes back
  // to poll again instead, between its other connections' turns, and catches the next message of
  // an exchange without one, at the price of a core while it lasts.
  if (more || absl::Now() < last_completion_ + settings_.poll_window) return Progress::kMore;
  return Progress::kWaiting;
}

bool VerbsConnection::OnTick(absl::Time now) {
  std::vector<std::function<void()>> callbacks;
  // A process that was stopped (or starved) finds what its peer sent meanwhile in the completion
  // queue, a REJECT saying it was the silent one among it: taken before the peer is judged.
  if (SilentPastTimeout(now)) PollCompletions(&callbacks);
  bool finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok() && established_) {
      // A message counts as received only once it completes, and the peer's heartbeats queue behind
      // it: on a slow or reordering link a long one can outlast the peer timeout while its packets
      // still arrive. They move the queue pair's receive PSN; a dead or cut-off peer's do not.
      if (now - last_receive_ > options_.peer_timeout / 2 && PeerPacketsArrivedLocked(now)) {
        last_receive_ = now;
      }
      if (now - last_receive_ > options_.peer_timeout) {
        // Told, so that a peer that was stopped or cut off and runs again knows the failure is its
        // own (PeerFoundThisProcessSilent).
        FailLocked(PeerError(absl::DeadlineExceededError(absl::StrCat(
                       "nothing received for ", absl::FormatDuration(now - last_receive_)))),
                   WentSilentReason(now - last_receive_), &callbacks);
      } else if (now - last_send_ >= options_.peer_timeout / 4 && posted_sends_ == 0) {
        // Behind work still posted a heartbeat adds nothing (that work's packets are heard), and
        // under reordering heartbeats piled behind a long write stalled rxe's queue pair for > 3 s.
        EnqueueFrameLocked({wire::FrameType::kPing, wire::Ping{}});
      }
    }
    finished = SettleCloseLocked(now, &callbacks);
  }
  for (auto& callback : callbacks) callback();
  return !finished;
}

bool VerbsConnection::SilentPastTimeout(absl::Time now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_.ok() && established_ && now - last_receive_ > options_.peer_timeout;
}

bool VerbsConnection::PeerPacketsArrivedLocked(absl::Time now) {
  const absl::StatusOr<uint32_t> psn = queue_pair_.NextReceivePsn();
  if (!psn.ok()) {
    LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: cannot tell whether packets from " << peer_name_ << " at "
                                 << peer_address_ << " arrive, so only its messages show it alive: "
                                 << psn.status();
    return false;
  }
  // A PSN asked for before the last message came may have moved with that message's own packets.
  const bool arrived = receive_psn_asked_ >= last_receive_ && *psn != receive_psn_;
  receive_psn_ = *psn;
  receive_psn_asked_ = now;
  return arrived;
}

bool VerbsConnection::PollCompletions(std::vector<std::function<void()>>* callbacks) {
  // Brief polling before giving up: a burst of messages is handled without a wakeup each.
  ibv_wc wcs[kPollBatchSize];
  bool any = false;
  int batches = 0;
  for (int empty = 0; empty < 64;) {
    const int n = ibv_poll_cq(queue_pair_.cq(), kPollBatchSize, wcs);
    if (n <= 0) {
      if (any) return false;
      ++empty;
      continue;
    }
    any = true;
    last_completion_ = absl::Now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int i = 0; i < n; ++i) HandleCompletion(wcs[i], callbacks);
      PumpLocked();
    }
    if (++batches == kPollBatches || callbacks->size() > 64) return true;
  }
  return false;
}

void VerbsConnection::HandleCmEvents(std::vector<std::function<void()>>* callbacks) {
  rdma_cm_event* event = nullptr;
  while (rdma_get_cm_event(queue_pair_.events(), &event) == 0) {
    const rdma_cm_event_type type = event->event;
    rdma_ack_cm_event(event);
    if (type != RDMA_CM_EVENT_DISCONNECTED && type != RDMA_CM_EVENT_DEVICE_REMOVAL) continue;
    // The peer's REJECT, if it sent one, is already in the completion queue: take its reason
    // first. (All of them: the bound that keeps the loop fair would leave it behind.)
    while (PollCompletions(callbacks)) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(PeerError(absl::UnavailableError(
                   type == RDMA_CM_EVENT_DISCONNECTED
                       ? "it disconnected (rdma_cm DISCONNECTED): it closed the connection or exited"
                       : absl::StrCat("RDMA device ", device_->name, " was removed"))),
               std::nullopt, callbacks);
    StopQueuePairLocked(callbacks);
  }
}

void VerbsConnection::HandleCompletion(const ibv_wc& wc, std::vector<std::function<void()>>* callbacks) {
  if (wc.wr_id & kReceiveBit) {
    posted_receives_--;
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) FailLocked(CompletionError(wc), std::nullopt, callbacks);
      return;
    }
    last_receive_ = absl::Now();
    const int slot = static_cast<int>(wc.wr_id & ~kReceiveBit);
    absl::Status handled;
    if (wc.opcode == IBV_WC_RECV) {
      const std::string bytes(queue_pair_.receive_buffer(slot), std::min<size_t>(wc.byte_len, kSlotSize));
      if (!stopped_) {
        absl::Status reposted = PostReceive(slot);
        if (!reposted.ok()) handled = reposted;
      }
      if (handled.ok()) {
        DrainInboxLocked(callbacks);
        handled = HandleMessageLocked(bytes, callbacks);
      }
    } else if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      if (!stopped_) handled = PostReceive(slot);
      if (handled.ok()) {
        if (!established_) {
          handled = PeerError(absl::DataLossError("RDMA write before the handshake completed"));
        } else {
          DrainInboxLocked(callbacks);
          const uint32_t imm = ntohl(wc.imm_data);
          handled = (imm & kGrantImmBit) ? OnGrantWrittenLocked(imm & ~kGrantImmBit, wc.byte_len)
                                         : OnDataLocked(imm, wc.byte_len, callbacks);
        }
      }
    }
    if (!handled.ok() && status_.ok()) {
      FailLocked(handled, ToldIfProtocolError(handled), callbacks);
    }
    return;
  }
  auto it = in_flight_.find(wc.wr_id);
  if (it == in_flight_.end()) return;
  InFlight flight = std::move(it->second);
  in_flight_.erase(it);
  posted_sends_--;
  window_bytes_ -= flight.bytes;
  if (flight.send_slot >= 0) free_send_slots_.push_back(flight.send_slot);
  absl::Status result;
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR) FailLocked(CompletionError(wc), std::nullopt, callbacks);
    result = status_.ok() ? absl::UnavailableError("work request flushed") : status_;
  }
  if (flight.done) {
    callbacks->push_back([done = std::move(flight.done), result] { done(result); });
  }
  if (flight.is_reject) StopQueuePairLocked(callbacks);
}

void VerbsConnection::DrainInboxLocked(std::vector<std::function<void()>>* callbacks) {
  while (established_ && !handshake_inbox_.empty() && status_.ok()) {
    const std::string bytes = std::move(handshake_inbox_.front());
    handshake_inbox_.pop_front();
    absl::Status handled = HandleMessageLocked(bytes, callbacks);
    if (!handled.ok()) FailLocked(handled, ToldIfProtocolError(handled), callbacks);
  }
}

absl::Status VerbsConnection::HandleMessageLocked(std::string_view bytes,
                                                  std::vector<std::function<void()>>* callbacks) {
  if (!status_.ok()) return absl::OkStatus();
  if (!established_) {
    handshake_inbox_.emplace_back(bytes);
    handshake_cv_.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<Message> message = DecodeMessage(bytes);
  if (!message.ok()) return PeerError(message.status());
  if (const auto* region = std::get_if<RegionMessage>(&*message)) {
    if (region->address + region->size < region->address) {
      return PeerError(absl::DataLossError(absl::StrCat("REGION ", region->region_id, " wraps around")));
    }
    if (!remote_regions_.emplace(region->region_id, RemoteRegion{region->address, region->size, region->rkey})
             .second) {
      return PeerError(absl::DataLossError(absl::StrCat("region ", region->region_id, " announced twice")));
    }
    return absl::OkStatus();
  }
  if (const auto* table = std::get_if<GrantTableMessage>(&*message)) {
    return OnGrantTableLocked(*table);
  }
  return DispatchLocked(std::get<wire::Frame>(*std::move(message)), callbacks);
}

absl::Status VerbsConnection::DispatchLocked(wire::Frame frame, std::vector<std::function<void()>>* callbacks) {
  switch (frame.type) {
    case wire::FrameType::kPing:
      return absl::OkStatus();
    case wire::FrameType::kData: {
      const auto& data = std::get<wire::Data>(frame.body);
      return OnDataLocked(data.grant_id, data.length, callbacks);
    }
    case wire::FrameType::kTooSmall: {
      const auto& too_small = std::get<wire::TooSmall>(frame.body);
      return OnGrantReturnedLocked(too_small.grant_id, TooSmallResult(too_small), true, callbacks);
    }
    case wire::FrameType::kRevoke:
      OnPeerRevokeLocked(std::get<wire::Revoke>(frame.body).grant_id);
      return absl::OkStatus();
    case wire::FrameType::kDiscard:
      OnPeerDiscardLocked(std::get<wire::Discard>(frame.body).tag, callbacks);
      return absl::OkStatus();
    case wire::FrameType::kWithdrawn:
      return OnWithdrawnLocked(std::get<wire::Withdrawn>(frame.body), callbacks);
    case wire::FrameType::kRevoked:
      return OnGrantReturnedLocked(std::get<wire::Revoked>(frame.body).grant_id,
                                   {absl::CancelledError("grant revoked"), 0}, false, callbacks);
    case wire::FrameType::kReject: {
      const auto& reject = std::get<wire::Reject>(frame.body);
      return PeerClosedConnection(peer_name_, peer_address_, reject.code, reject.message);
    }
    default:
      return PeerError(absl::DataLossError(absl::StrCat(
          "unexpected ", wire::FrameTypeName(frame.type), " message after the handshake")));
  }
}

absl::Status VerbsConnection::OnGrantTableLocked(const GrantTableMessage& table) {
  absl::Status announced = grant_tables_.OnPeerTable(table);
  if (!announced.ok()) return PeerError(announced);
  PumpLocked();
  return absl::OkStatus();
}

absl::Status VerbsConnection::OnGrantWrittenLocked(uint32_t table_slot, uint32_t length) {
  if (!status_.ok()) return absl::OkStatus();
  absl::StatusOr<wire::Grant> grant = grant_tables_.Read(table_slot, length);
  if (!grant.ok()) return PeerError(grant.status());
  return OnRemoteGrantLocked(*grant);
}

absl::Status VerbsConnection::OnRemoteGrantLocked(const wire::Grant& grant) {
  if (grant.grant_id == 0 || grant.grant_id >= kGrantImmBit) {
    // Its data's immediate would read as a grant record's.
    return PeerError(absl::DataLossError(absl::StrCat("grant id ", grant.grant_id, " out of range")));
  }
  auto region = remote_regions_.find(grant.region_id);
  if (region == remote_regions_.end()) {
    return PeerError(absl::DataLossError(
        absl::StrCat("GRANT in region ", grant.region_id, ", which the peer never announced")));
  }
  if (grant.offset > region->second.size || grant.capacity > region->second.size - grant.offset) {
    return PeerError(absl::DataLossError(absl::StrCat("GRANT of [", grant.offset, ", +", grant.capacity,
                                                      ") outside region ", grant.region_id, " of ",
                                                      region->second.size, " bytes")));
  }
  absl::StatusOr<GrantBook<PendingWrite>::Pairing> pairing = book_.OnPeerGrant(grant);
  if (!pairing.ok()) return PeerError(pairing.status());
  EnqueuePairingLocked(*std::move(pairing));
  return absl::OkStatus();
}

absl::Status VerbsConnection::OnDataLocked(uint64_t grant_id, uint64_t length,
                                           std::vector<std::function<void()>>* callbacks) {
  absl::Status written = CheckWrittenLocked(grant_id, "DATA");
  if (!written.ok()) return written;
  absl::StatusOr<IssuedGrant> grant = book_.TakeFilled(grant_id, length);
  if (!grant.ok()) return PeerError(grant.status());
  grant_tables_.Release(grant_id);
  callbacks->push_back([done = std::move(grant->done), length] { done({absl::OkStatus(), length}); });
  return absl::OkStatus();
}

absl::Status VerbsConnection::OnGrantReturnedLocked(uint64_t grant_id, GrantResult result,
                                                    bool must_exceed_capacity,
                                                    std::vector<std::function<void()>>* callbacks) {
  absl::Status written = CheckWrittenLocked(grant_id, must_exceed_capacity ? "TOO_SMALL" : "REVOKED");
  if (!written.ok()) return written;
  absl::StatusOr<IssuedGrant> grant =
      book_.TakeReturned(grant_id, must_exceed_capacity ? std::optional<uint64_t>(result.length) : std::nullopt);
  if (!grant.ok()) return PeerError(grant.status());
  grant_tables_.Release(grant_id);
  callbacks->push_back([done = std::move(grant->done), result] { done(result); });
  return absl::OkStatus();
}

void VerbsConnection::OnPeerRevokeLocked(uint64_t grant_id) {
  if (book_.OnPeerRevoke(grant_id)) EnqueueFrameLocked({wire::FrameType::kRevoked, wire::Revoked{grant_id}});
}

void VerbsConnection::OnPeerDiscardLocked(const Tag& tag, std::vector<std::function<void()>>* callbacks) {
  for (auto& write : book_.DiscardWrites(tag)) {
    callbacks->push_back([done = std::move(write.done)] { done(DiscardedWrite()); });
  }
}

absl::Status VerbsConnection::OnWithdrawnLocked(const wire::Withdrawn& withdrawn,
                                                std::vector<std::function<void()>>* callbacks) {
  absl::Status written = CheckWrittenLocked(withdrawn.grant_id, "WITHDRAWN");
  if (!written.ok()) return written;
  absl::StatusOr<IssuedGrant> grant = book_.TakeWithdrawn(withdrawn.grant_id);
  if (!grant.ok()) return PeerError(grant.status());
  grant_tables_.Release(withdrawn.grant_id);
  callbacks->push_back([done = std::move(grant->done),
                        status = PeerWithdrewMessage(peer_name_, peer_address_, withdrawn.code, withdrawn.reason)] {
    done({status, 0});
  });
  return absl::OkStatus();
}

absl::Status VerbsConnection::CheckWrittenLocked(uint64_t grant_id, std::string_view answer) const {
  if (grant_tables_.IsWritten(grant_id)) return absl::OkStatus();
  return PeerError(
      absl::DataLossError(absl::StrCat(answer, " for grant ", grant_id, ", which is not outstanding")));
}

void VerbsConnection::TakeLoopCallbacksLocked(std::vector<std::function<void()>>* callbacks) {
  for (auto& callback : loop_callbacks_) callbacks->push_back(std::move(callback));
  loop_callbacks_.clear();
}

}  // namespace tf_rdma::verbs
