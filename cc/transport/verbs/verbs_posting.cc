// Posting work requests (ibv_post_send(3), ibv_post_recv(3)): the control messages, grant records
// and data of the outgoing queues, as the send queue, the send buffers and the write window allow.
#include "cc/transport/verbs/verbs_connection.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
absl::Status VerbsConnection::PostReceive(int slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(queue_pair_.receive_buffer(slot)), kSlotSize,
              queue_pair_.receive_lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = kReceiveBit | static_cast<uint64_t>(slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(queue_pair_.qp(), &wr, &bad);
  if (rc != 0) return absl::InternalError(absl::StrCat("ibv_post_recv: ", std::strerror(rc)));
  posted_receives_++;
  return absl::OkStatus();
}

void VerbsConnection::EnqueueControlLocked(std::string message, Window* bind_first,
                                           std::shared_ptr<MemoryRegion> region) {
  control_queue_.push_back(QueuedControl{std::move(message), bind_first, std::move(region)});
  PumpLocked();
}

void VerbsConnection::SweepWindowsLocked() {
  if (region_windows_.size() < sweep_at_) return;
  // Regions stay announced while queued REGION messages point at their windows; those are alive.
  for (auto it = region_windows_.begin(); it != region_windows_.end();) {
    it = it->second.region.expired() ? region_windows_.erase(it) : std::next(it);
  }
  sweep_at_ = std::max<size_t>(64, 2 * region_windows_.size());
}

absl::Status VerbsConnection::OpenWindow(Window& window, const Registration& registration,
                                         const void* addr, uint64_t length, VerbsRegion* owner) {
  if (!device_->memory_windows) {
    window.rkey = registration.rkey();
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<MemoryWindow>> allocated =
      owner != nullptr ? owner->NewWindow(device_->pd) : MemoryWindow::Allocate(device_->pd);
  if (!allocated.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate a memory window on RDMA device ", device_->name, " for peer ", peer_address_,
        ": ", allocated.status().message(),
        " (each connection takes one per receive region it is granted)"));
  }
  window.mw = *std::move(allocated);
  window.rkey = ibv_inc_rkey(window.mw->get()->rkey);
  window.bind = ibv_mw_bind_info{registration.mr(), reinterpret_cast<uint64_t>(addr), length,
                                 IBV_ACCESS_REMOTE_WRITE};
  window.bound = false;
  return absl::OkStatus();
}

absl::Status VerbsConnection::PostBindLocked(Window& window, std::shared_ptr<MemoryRegion> region) {
  ibv_send_wr wr{};
  wr.wr_id = next_wr_id_++;
  wr.opcode = IBV_WR_BIND_MW;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.bind_mw.mw = window.mw->get();
  wr.bind_mw.rkey = window.rkey;
  wr.bind_mw.bind_info = window.bind;
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(queue_pair_.qp(), &wr, &bad);
  if (rc != 0) return absl::InternalError(absl::StrCat("ibv_post_send (bind a memory window): ", std::strerror(rc)));
  posted_sends_++;
  InFlight flight;
  flight.region = std::move(region);
  in_flight_.emplace(wr.wr_id, std::move(flight));
  window.bound = true;
  return absl::OkStatus();
}

absl::Status VerbsConnection::PostControlLocked(const std::string& message, bool is_reject,
                                                int table_slot) {
  const int slot = free_send_slots_.back();
  char* buffer = queue_pair_.send_buffer(slot);
  std::memcpy(buffer, message.data(), message.size());
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer), static_cast<uint32_t>(message.size()),
              queue_pair_.send_lkey()};
  ibv_send_wr wr{};
  wr.wr_id = next_wr_id_++;
  wr.opcode = IBV_WR_SEND;
  if (table_slot >= 0) {
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(kGrantImmBit | static_cast<uint32_t>(table_slot));
    wr.wr.rdma.remote_addr = grant_tables_.PeerSlotAddress(static_cast<uint32_t>(table_slot));
    wr.wr.rdma.rkey = grant_tables_.peer_rkey();
  }
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(queue_pair_.qp(), &wr, &bad);
  if (rc != 0) return absl::InternalError(absl::StrCat("ibv_post_send: ", std::strerror(rc)));
  free_send_slots_.pop_back();
  posted_sends_++;
  last_send_ = absl::Now();
  InFlight flight;
  flight.send_slot = slot;
  flight.is_reject = is_reject;
  in_flight_.emplace(wr.wr_id, std::move(flight));
  return absl::OkStatus();
}

bool VerbsConnection::PostDataLocked(Outgoing& item) {
  const wire::Grant& grant = item.grant;
  const RemoteRegion& remote = remote_regions_.at(grant.region_id);
  const uint64_t length = item.write.length;
  const bool single = length <= max_single_write_;
  while (item.posted < length || (length == 0 && single)) {
    if (posted_sends_ >= kSendDepth || (window_bytes_ > 0 && window_bytes_ >= kWriteWindow)) return false;
    const uint64_t chunk = std::min(single ? max_single_write_ : kMultiPartChunk, length - item.posted);
    ibv_sge sge{reinterpret_cast<uint64_t>(item.write.src) + item.posted, static_cast<uint32_t>(chunk),
                item.write.registration ? item.write.registration->lkey() : 0};
    ibv_send_wr wr{};
    wr.wr_id = next_wr_id_++;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.sg_list = chunk > 0 ? &sge : nullptr;
    wr.num_sge = chunk > 0 ? 1 : 0;
    wr.wr.rdma.remote_addr = remote.address + grant.offset + item.posted;
    wr.wr.rdma.rkey = remote.rkey;
    // A message that fits one work request is one WRITE_WITH_IMM: the immediate names the grant,
    // and the receiver's completion carries the length.
    wr.opcode = single ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    if (single) wr.imm_data = htonl(static_cast<uint32_t>(grant.grant_id));
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(queue_pair_.qp(), &wr, &bad) != 0) return false;  // retried on the next completion
    InFlight flight;
    flight.bytes = chunk;
    flight.registration = item.write.registration;
    if (single) flight.done = std::move(item.write.done);
    posted_sends_++;
    window_bytes_ += chunk;
    last_send_ = absl::Now();
    in_flight_.emplace(wr.wr_id, std::move(flight));
    item.posted += chunk;
    if (single) return true;
  }
  // A multi-part message: the DATA message reports it once every WRITE before it has landed.
  if (free_send_slots_.empty() || posted_sends_ >= kSendDepth) return false;
  const std::string data = wire::Encode({wire::FrameType::kData, wire::Data{grant.grant_id, length}});
  if (!PostControlLocked(data, false).ok()) return false;
  // The DATA message's completion is the write's completion.
  InFlight& flight = in_flight_.at(next_wr_id_ - 1);
  flight.done = std::move(item.write.done);
  flight.registration = item.write.registration;
  return true;
}

void VerbsConnection::PumpLocked() {
  if (stopped_ || !status_.ok()) return;
  while (!control_queue_.empty() && !free_send_slots_.empty() && posted_sends_ < kSendDepth) {
    QueuedControl& next = control_queue_.front();
    // The send queue runs in order: the window is bound before the peer can learn its key.
    if (next.bind_first != nullptr && !next.bind_first->bound) {
      absl::Status bound = PostBindLocked(*next.bind_first, next.region);
      if (!bound.ok()) {
        LOG_EVERY_N_SEC(ERROR, 10) << bound;
        break;
      }
      continue;
    }
    absl::Status posted = PostControlLocked(next.message, false);
    if (!posted.ok()) break;
    control_queue_.pop_front();
  }
  // Once every control message queued before them is out, so a grant's REGION precedes it.
  while (control_queue_.empty() && !free_send_slots_.empty() && posted_sends_ < kSendDepth) {
    std::optional<GrantTables::SlotWrite> next = grant_tables_.NextWrite();
    if (!next) break;
    if (!PostControlLocked(EncodeGrantRecord(next->grant), false, static_cast<int>(next->slot)).ok()) break;
    grant_tables_.Wrote();
  }
  while (!data_queue_.empty() && PostDataLocked(data_queue_.front())) data_queue_.pop_front();
}

}  // namespace tf_rdma::verbs
