// How a connection fails and closes: the error it records, the REJECT telling the peer, the queue
// pair stopped (no write can land any more), its work requests flushed, and what they carried
// completed.
#include "cc/transport/verbs/verbs_connection.h"

#include <algorithm>
#include <string>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/peer_errors.h"

namespace tf_rdma::verbs {
namespace {

// How long Close waits for the REJECT telling the peer why to be sent before stopping the QP.
constexpr absl::Duration kRejectGrace = absl::Milliseconds(200);
// How long a closed connection waits for its posted work requests to be flushed.
constexpr absl::Duration kFlushLimit = absl::Seconds(2);
// The loops' tick at most: a closing connection's kRejectGrace ends within this much.
constexpr absl::Duration kCloseTick = absl::Milliseconds(50);

}  // namespace

absl::Duration VerbsConnection::LoopTick(const TransportOptions& options) {
  return std::min(options.peer_timeout / 8, kCloseTick);
}

void VerbsConnection::Close(const absl::Status& reason) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Status closed = reason.ok() ? absl::CancelledError("connection closed") : reason;
    FailLocked(closed, closed, &callbacks);
  }
  for (auto& callback : callbacks) callback();
  Wake();
}

void VerbsConnection::AwaitFinished() {
  std::unique_lock<std::mutex> lock(mu_);
  // Bounded however the loop fares: the REJECT's grace, the flush limit and a few ticks.
  finished_cv_.wait_for(lock, absl::ToChronoNanoseconds(kRejectGrace + kFlushLimit + 4 * kCloseTick),
                        [this] { return finished_; });
}

void VerbsConnection::FailLocked(const absl::Status& reason, const std::optional<absl::Status>& told_peer,
                                 std::vector<std::function<void()>>* callbacks) {
  if (!status_.ok()) return;
  status_ = reason;
  handshake_cv_.notify_all();
  for (auto& write : book_.TakeAllWaiting()) {
    callbacks->push_back([done = std::move(write.done), reason] { done(reason); });
  }
  for (auto& item : data_queue_) {
    if (item.posted == 0) {
      callbacks->push_back([done = std::move(item.write.done), reason] { done(reason); });
    } else {
      // Part of it is posted: the NIC may still read the buffer until those are flushed.
      deferred_write_dones_.push_back(std::move(item.write.done));
    }
  }
  data_queue_.clear();
  control_queue_.clear();
  grant_tables_.DropUnwritten();
  if (!reason.ok() && reason.code() != absl::StatusCode::kCancelled) {
    LOG(WARNING) << "tf_rdma: verbs connection to " << peer_name_ << " at " << peer_address_
                 << " closed: " << reason;
  }
  if (told_peer && !free_send_slots_.empty() && posted_sends_ < kSendDepth &&
      PostControlLocked(wire::Encode({wire::FrameType::kReject,
                                      wire::Reject{static_cast<uint32_t>(told_peer->code()),
                                                   std::string(told_peer->message().substr(0, 3000))}}),
                        true)
          .ok()) {
    // The grants stay outstanding until the REJECT is out (or kRejectGrace passed): see the loop.
    stop_deadline_ = absl::Now() + kRejectGrace;
    return;
  }
  StopQueuePairLocked(callbacks);
}

void VerbsConnection::StopQueuePairLocked(std::vector<std::function<void()>>* callbacks) {
  if (stopped_) return;
  stopped_ = true;
  stop_deadline_ = absl::Now();
  // In the error state the QP accepts no more writes: only now are the granted ranges free again.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(queue_pair_.qp(), &attr, IBV_QP_STATE);
  rdma_disconnect(queue_pair_.id());
  for (auto& grant : book_.TakeAllIssued()) {
    callbacks->push_back([done = std::move(grant.done), status = status_] { done({status, 0}); });
  }
  grant_tables_.ForgetWritten();
}

bool VerbsConnection::SettleCloseLocked(absl::Time now, std::vector<std::function<void()>>* callbacks) {
  if (finished_) return true;
  if (status_.ok()) return false;
  if (!stopped_ && now >= stop_deadline_) StopQueuePairLocked(callbacks);
  if (!stopped_) return false;
  const bool drained = posted_sends_ == 0 && posted_receives_ == 0;
  if (!drained && now - stop_deadline_ <= kFlushLimit) return false;
  CompletePostedLocked(callbacks);
  return true;
}

void VerbsConnection::CompletePostedLocked(std::vector<std::function<void()>>* callbacks) {
  for (auto& done : deferred_write_dones_) {
    callbacks->push_back([done = std::move(done), status = status_] { done(status); });
  }
  deferred_write_dones_.clear();
  for (auto& [id, flight] : in_flight_) {
    if (flight.done) callbacks->push_back([done = std::move(flight.done), status = status_] { done(status); });
  }
  in_flight_.clear();
  finished_ = true;
  finished_cv_.notify_all();
}

void VerbsConnection::OnLoopStopped() {
  // The transport waited for its closed connections (AwaitFinished); one still here is cut short:
  // no loop would see its REJECT or its flush any more.
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(absl::CancelledError("the local tf_rdma transport shut down"), std::nullopt, &callbacks);
    StopQueuePairLocked(&callbacks);
  }
  PollCompletions(&callbacks);
  {
    std::lock_guard<std::mutex> lock(mu_);
    CompletePostedLocked(&callbacks);
    TakeLoopCallbacksLocked(&callbacks);
  }
  for (auto& callback : callbacks) callback();
}

absl::Status VerbsConnection::PeerError(const absl::Status& cause) const {
  return PeerFailure(peer_name_, peer_address_, cause);
}

absl::Status VerbsConnection::CompletionError(const ibv_wc& wc) const {
  std::string what;
  switch (wc.status) {
    case IBV_WC_RETRY_EXC_ERR:
      what = "the peer stopped acknowledging (transport retry counter exceeded): it died, or the "
             "RDMA path to it is down";
      break;
    case IBV_WC_RNR_RETRY_EXC_ERR:
      what = "the peer stopped accepting messages (receiver-not-ready retries exceeded)";
      break;
    case IBV_WC_REM_ACCESS_ERR:
      what = "the peer refused an RDMA write into its region (remote access error)";
      break;
    case IBV_WC_REM_INV_REQ_ERR:
      what = "the peer's queue pair rejected a request (remote invalid request)";
      break;
    case IBV_WC_LOC_QP_OP_ERR:
      what = "the local queue pair could not send (local QP operation error)";
      break;
    default:
      what = ibv_wc_status_str(wc.status);
  }
  // A port that went down explains most of these: say so.
  ibv_port_attr port{};
  std::string link;
  const int port_num = queue_pair_.id()->port_num;
  if (ibv_query_port(device_->context, port_num, &port) == 0 && port.state != IBV_PORT_ACTIVE) {
    link = absl::StrCat("; port ", port_num, " of ", device_->name,
                        " is not ACTIVE now: check its link (`ibv_devinfo`, `rdma link`)");
  }
  return PeerError(absl::UnavailableError(absl::StrCat(
      what, " [", ibv_wc_status_str(wc.status), ", vendor error 0x", absl::Hex(wc.vendor_err),
      ", device ", device_->name, "]", link)));
}

}  // namespace tf_rdma::verbs
