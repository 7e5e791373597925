#include "cc/transport/verbs/verbs_connection.h"

#include <arpa/inet.h>
#include <sys/epoll.h>

#include <algorithm>
#include <cstring>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/peer_errors.h"

namespace tf_rdma::verbs {
namespace {

constexpr int kReceiveDepth = QueuePair::kReceiveDepth;
constexpr int kSendSlots = QueuePair::kSendSlots;
constexpr int kSendDepth = QueuePair::kSendDepth;
constexpr size_t kSlotSize = QueuePair::kSlotSize;
constexpr uint64_t kReceiveBit = uint64_t{1} << 63;
// One WRITE_WITH_IMM carries messages up to this size; beyond, WRITEs of this size and a DATA message.
constexpr uint64_t kMaxSingleWrite = uint64_t{16} << 20;
// Bigger messages go in WRITEs of this size.
constexpr uint64_t kMultiPartChunk = uint64_t{4} << 20;
// At most this many data bytes are posted and not completed per connection, so a heartbeat or grant
// posted behind data waits for at most that much to drain (a slow link must not look like a dead
// peer). It admits four messages of the largest single write, as many as a receiver granting four
// ahead lets be in flight, so they follow one another on the wire without a round trip between
// them. 64 MiB drains in about 5 ms at 100 Gb/s and in 3-4 s on Soft-RoCE under TCG (~20 MB/s),
// far inside the default peer timeout (30 s); the price is that a grant queued behind a full window
// reaches the peer that much later, while its data towards us waits for it.
constexpr uint64_t kWriteWindow = 4 * kMaxSingleWrite;
// How long Close waits for the REJECT telling the peer why to be sent before stopping the QP.
constexpr absl::Duration kRejectGrace = absl::Milliseconds(200);
// How long a closed connection waits for its posted work requests to be flushed.
constexpr absl::Duration kFlushLimit = absl::Seconds(2);
// The loops' tick at most: a closing connection's kRejectGrace ends within this much.
constexpr absl::Duration kCloseTick = absl::Milliseconds(50);
// Completion batches one call of the loop handles at most, so that one connection's stream of
// completions cannot starve the loop's other connections.
constexpr int kPollBatchSize = 32;
constexpr int kPollBatches = 16;

}  // namespace

absl::StatusOr<std::shared_ptr<VerbsConnection>> VerbsConnection::Create(
    rdma_cm_id* id, rdma_event_channel* events, std::shared_ptr<DeviceContext> device,
    const TransportOptions& options, const VerbsSettings& settings, std::string peer_address) {
  std::shared_ptr<VerbsConnection> connection(
      new VerbsConnection(id, events, std::move(device), options, settings, std::move(peer_address)));
  absl::Status setup = connection->Setup();
  if (!setup.ok()) return setup;
  return connection;
}

VerbsConnection::VerbsConnection(rdma_cm_id* id, rdma_event_channel* events,
                                 std::shared_ptr<DeviceContext> device, const TransportOptions& options,
                                 const VerbsSettings& settings, std::string peer_address)
    : device_(std::move(device)),
      options_(options),
      settings_(settings),
      peer_address_(std::move(peer_address)),
      peer_name_(peer_address_),
      queue_pair_(id, events) {}

VerbsConnection::~VerbsConnection() {
  // Windows bound to the queue pair go before it, the grant table's before its registration.
  if (grant_table_window_.mw != nullptr) grant_table_window_.mw->Deallocate();
  for (auto& [id, window] : region_windows_) {
    if (window.mw != nullptr) window.mw->Deallocate();
  }
}

absl::Status VerbsConnection::Setup() {
  absl::Status opened = queue_pair_.Open(*device_, peer_address_);
  if (!opened.ok()) return opened;
  // The only memory of ours this peer may write without a grant: pages of its own, in this QP's PD.
  absl::Status table = grant_tables_.Allocate(device_->pd, device_->remote_region_access());
  if (!table.ok()) return table;
  absl::Status window = OpenWindow(grant_table_window_, grant_tables_.local_registration(), grant_tables_.local(),
                                   GrantTables::kBytes, nullptr);
  if (!window.ok()) return window;
  for (int i = kSendSlots - 1; i >= 0; --i) free_send_slots_.push_back(i);
  ibv_port_attr port{};
  max_single_write_ = kMaxSingleWrite;
  if (ibv_query_port(device_->context, queue_pair_.id()->port_num, &port) == 0 && port.max_msg_sz > 0) {
    max_single_write_ = std::min<uint64_t>(max_single_write_, port.max_msg_sz);
  }
  return absl::OkStatus();
}

absl::Status VerbsConnection::Transition(ibv_qp_state state) {
  absl::Status moved = queue_pair_.Transition(state, settings_.gid_index, device_->name);
  if (!moved.ok()) return moved;
  if (state == IBV_QPS_INIT) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int slot = 0; slot < kReceiveDepth; ++slot) {
      absl::Status posted = PostReceive(slot);
      if (!posted.ok()) return posted;
    }
  }
  return absl::OkStatus();
}

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

absl::Duration VerbsConnection::LoopTick(const TransportOptions& options) {
  return std::min(options.peer_timeout / 8, kCloseTick);
}

void VerbsConnection::Start(IoLoops& loops) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_receive_ = last_send_ = absl::Now();
  }
  // Without a loop (its thread could not start, the transport shuts down), this peer's connection
  // fails, not the process; its handshake then fails on the closed connection.
  absl::StatusOr<std::shared_ptr<IoLoop>> loop = loops.Next();
  absl::Status added = loop.ok() ? (*loop)->Add(queue_pair_.epoll_fd(), shared_from_this()) : loop.status();
  if (!added.ok()) Close(added);
}

void VerbsConnection::AwaitFinished() {
  std::unique_lock<std::mutex> lock(mu_);
  // Bounded however the loop fares: the REJECT's grace, the flush limit and a few ticks.
  finished_cv_.wait_for(lock, absl::ToChronoNanoseconds(kRejectGrace + kFlushLimit + 4 * kCloseTick),
                        [this] { return finished_; });
}

void VerbsConnection::Established(const PeerIdentity& peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    peer_name_ = peer.name;
    peer_build_ = peer.build;
    established_ = true;
    last_receive_ = last_send_ = absl::Now();
    EnqueueControlLocked(EncodeGrantTable(grant_tables_.Announcement(grant_table_window_.rkey)),
                         &grant_table_window_);
  }
  Wake();
}

void VerbsConnection::Wake() { queue_pair_.Wake(); }

absl::Status VerbsConnection::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

// ---- the handshake channel ----

absl::Status VerbsConnection::Channel::Send(const wire::Frame& frame) {
  VerbsConnection* c = connection_;
  std::lock_guard<std::mutex> lock(c->mu_);
  if (!c->status_.ok()) return c->status_;
  c->EnqueueFrameLocked(frame);
  return absl::OkStatus();
}

absl::StatusOr<wire::Frame> VerbsConnection::Channel::Receive(absl::Time deadline) {
  VerbsConnection* c = connection_;
  std::unique_lock<std::mutex> lock(c->mu_);
  while (c->handshake_inbox_.empty() && c->status_.ok()) {
    if (c->handshake_cv_.wait_for(lock, absl::ToChronoNanoseconds(deadline - absl::Now())) ==
            std::cv_status::timeout &&
        absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the peer sent no handshake message in time");
    }
  }
  if (c->handshake_inbox_.empty()) return c->status_;
  const std::string bytes = std::move(c->handshake_inbox_.front());
  c->handshake_inbox_.pop_front();
  absl::StatusOr<Message> message = DecodeMessage(bytes);
  if (!message.ok()) return message.status();
  if (!std::holds_alternative<wire::Frame>(*message)) {
    return absl::DataLossError("REGION or GRANT_TABLE message during the handshake");
  }
  return std::get<wire::Frame>(*std::move(message));
}

// ---- receiver side ----

uint64_t VerbsConnection::Grant(const Tag& tag, std::shared_ptr<MemoryRegion> region, uint64_t offset,
                                uint64_t capacity, GrantDone done) {
  absl::Status fits = CheckGrantRange(region.get(), offset, capacity);
  if (!fits.ok()) {
    done({fits, 0});
    return 0;
  }
  auto* verbs_region = dynamic_cast<VerbsRegion*>(region.get());
  const Registration* registration =
      verbs_region ? verbs_region->RegistrationFor(device_->pd) : nullptr;
  if (registration == nullptr) {
    done({absl::InvalidArgumentError(absl::StrCat(
              "a verbs connection can grant only regions allocated by the verbs transport that "
              "owns it (registered with device ", device_->name, ")")),
          0});
    return 0;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) {
    absl::Status status = status_;
    lock.unlock();
    done({status, 0});
    return 0;
  }
  const uint32_t region_id = region->id();
  if (auto [it, announce] = region_windows_.try_emplace(region_id); announce) {
    Window& window = it->second;
    absl::Status opened = OpenWindow(window, *registration, region->data(), region->size(), verbs_region);
    if (!opened.ok()) {
      region_windows_.erase(it);
      lock.unlock();
      done({opened, 0});
      return 0;
    }
    window.region = region;
    EnqueueControlLocked(EncodeRegion({region_id, window.rkey, reinterpret_cast<uint64_t>(region->data()),
                                       region->size()}),
                         &window, region);
    SweepWindowsLocked();
  }
  const uint64_t id = book_.Issue(tag, std::move(region), offset, capacity, std::move(done));
  grant_tables_.Queue(wire::Grant{id, tag, region_id, offset, capacity});
  PumpLocked();
  return id;
}

void VerbsConnection::Revoke(uint64_t grant_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return;
    if (!grant_tables_.Unqueue(grant_id)) {
      if (book_.StartRevoke(grant_id)) EnqueueFrameLocked({wire::FrameType::kRevoke, wire::Revoke{grant_id}});
      return;
    }
    // The peer never saw it: nothing to ask back. Its callback runs on the loop, never inside
    // Revoke (transport.h).
    absl::StatusOr<IssuedGrant> unseen = book_.Withdraw(grant_id);
    if (!unseen.ok()) return;
    loop_callbacks_.push_back(
        [done = std::move(unseen->done)] { done({absl::CancelledError("grant revoked"), 0}); });
  }
  Wake();
}

// ---- sender side ----

void VerbsConnection::Write(const Tag& tag, const void* src, uint64_t length, WriteDone done) {
  std::shared_ptr<Registration> registration;
  if (length > 0) {
    // Registering may take a while (pinning); done before the lock, and a failure fails only this
    // write: no grant was used yet.
    absl::StatusOr<std::shared_ptr<Registration>> acquired = device_->send_cache->Acquire(src, length);
    if (!acquired.ok()) {
      done(acquired.status());
      return;
    }
    registration = *std::move(acquired);
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) {
    absl::Status status = status_;
    lock.unlock();
    done(status);
    return;
  }
  GrantBook<PendingWrite>::Pairing pairing =
      book_.OnWrite(tag, PendingWrite{src, length, std::move(registration), std::move(done)});
  if (pairing.discarded) {
    lock.unlock();
    pairing.discarded->done(DiscardedWrite());
    return;
  }
  EnqueuePairingLocked(std::move(pairing));
}

void VerbsConnection::Withdraw(const Tag& tag) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DropWritesLocked(tag, &callbacks);
  }
  for (auto& callback : callbacks) callback();
}

void VerbsConnection::Discard(const Tag& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_.ok()) EnqueueFrameLocked({wire::FrameType::kDiscard, wire::Discard{tag}});
}

void VerbsConnection::EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing) {
  for (const wire::TooSmall& too_small : pairing.too_small) {
    EnqueueFrameLocked({wire::FrameType::kTooSmall, too_small});
  }
  if (pairing.ready) {
    data_queue_.push_back(Outgoing{pairing.ready->first, std::move(pairing.ready->second)});
    PumpLocked();
  }
}

void VerbsConnection::Close(const absl::Status& reason) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(reason.ok() ? absl::CancelledError("connection closed") : reason, true, &callbacks);
  }
  for (auto& callback : callbacks) callback();
  Wake();
}

// ---- posting ----

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

// ---- failure ----

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

void VerbsConnection::FailLocked(const absl::Status& reason, bool tell_peer,
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
  if (tell_peer && !free_send_slots_.empty() && posted_sends_ < kSendDepth &&
      PostControlLocked(wire::Encode({wire::FrameType::kReject,
                                      wire::Reject{static_cast<uint32_t>(reason.code()),
                                                   std::string(reason.message().substr(0, 3000))}}),
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

// ---- progress: on the loop's thread ----

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
  bool finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok() && established_) {
      if (now - last_receive_ > options_.peer_timeout) {
        FailLocked(PeerError(absl::DeadlineExceededError(absl::StrCat(
                       "nothing received for ", absl::FormatDuration(now - last_receive_)))),
                   false, &callbacks);
      } else if (now - last_send_ >= options_.peer_timeout / 4) {
        EnqueueFrameLocked({wire::FrameType::kPing, wire::Ping{}});
      }
    }
    finished = SettleCloseLocked(now, &callbacks);
  }
  for (auto& callback : callbacks) callback();
  return !finished;
}

void VerbsConnection::OnLoopStopped() {
  // The transport waited for its closed connections (AwaitFinished); one still here is cut short:
  // no loop would see its REJECT or its flush any more.
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(absl::CancelledError("the local tf_rdma transport shut down"), false, &callbacks);
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

void VerbsConnection::TakeLoopCallbacksLocked(std::vector<std::function<void()>>* callbacks) {
  for (auto& callback : loop_callbacks_) callbacks->push_back(std::move(callback));
  loop_callbacks_.clear();
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
               false, callbacks);
    StopQueuePairLocked(callbacks);
  }
}

void VerbsConnection::HandleCompletion(const ibv_wc& wc, std::vector<std::function<void()>>* callbacks) {
  if (wc.wr_id & kReceiveBit) {
    posted_receives_--;
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) FailLocked(CompletionError(wc), false, callbacks);
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
      FailLocked(handled, handled.code() == absl::StatusCode::kDataLoss, callbacks);
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
    if (wc.status != IBV_WC_WR_FLUSH_ERR) FailLocked(CompletionError(wc), false, callbacks);
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
    if (!handled.ok()) FailLocked(handled, handled.code() == absl::StatusCode::kDataLoss, callbacks);
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
      return OnGrantReturnedLocked(
          too_small.grant_id,
          {absl::ResourceExhaustedError(absl::StrCat("the message needs ", too_small.needed,
                                                     " bytes, more than granted")),
           too_small.needed},
          true, callbacks);
    }
    case wire::FrameType::kRevoke:
      OnPeerRevokeLocked(std::get<wire::Revoke>(frame.body).grant_id);
      return absl::OkStatus();
    case wire::FrameType::kDiscard:
      DropWritesLocked(std::get<wire::Discard>(frame.body).tag, callbacks);
      return absl::OkStatus();
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

void VerbsConnection::DropWritesLocked(const Tag& tag, std::vector<std::function<void()>>* callbacks) {
  for (auto& write : book_.Discard(tag)) {
    callbacks->push_back([done = std::move(write.done)] { done(DiscardedWrite()); });
  }
}

void VerbsConnection::OnPeerRevokeLocked(uint64_t grant_id) {
  if (book_.OnPeerRevoke(grant_id)) EnqueueFrameLocked({wire::FrameType::kRevoked, wire::Revoked{grant_id}});
}

absl::Status VerbsConnection::CheckWrittenLocked(uint64_t grant_id, std::string_view answer) const {
  if (grant_tables_.IsWritten(grant_id)) return absl::OkStatus();
  return PeerError(
      absl::DataLossError(absl::StrCat(answer, " for grant ", grant_id, ", which is not outstanding")));
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

}  // namespace tf_rdma::verbs
