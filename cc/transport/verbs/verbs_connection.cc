#include "cc/transport/verbs/verbs_connection.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
namespace {

constexpr int kReceiveDepth = QueuePair::kReceiveDepth;
constexpr int kSendSlots = QueuePair::kSendSlots;

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
    absl::StatusOr<IssuedGrant> unseen = book_.TakeUnseen(grant_id);
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

void VerbsConnection::Withdraw(const Tag& tag, const absl::Status& why) {
  GrantBook<PendingWrite>::Withdrawal withdrawal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    withdrawal = book_.Withdraw(tag, why);
    if (status_.ok()) {
      for (const wire::Withdrawn& answer : withdrawal.withdrawn) {
        EnqueueFrameLocked({wire::FrameType::kWithdrawn, answer});
      }
    }
  }
  for (auto& write : withdrawal.writes) write.done(DiscardedWrite());
}

void VerbsConnection::DiscardPeerWrites(const Tag& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_.ok()) EnqueueFrameLocked({wire::FrameType::kDiscard, wire::Discard{tag}});
}

void VerbsConnection::EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing) {
  for (const wire::TooSmall& too_small : pairing.too_small) {
    EnqueueFrameLocked({wire::FrameType::kTooSmall, too_small});
  }
  for (const wire::Withdrawn& withdrawn : pairing.withdrawn) {
    EnqueueFrameLocked({wire::FrameType::kWithdrawn, withdrawn});
  }
  if (pairing.ready) {
    data_queue_.push_back(Outgoing{pairing.ready->first, std::move(pairing.ready->second)});
    PumpLocked();
  }
}

}  // namespace tf_rdma::verbs
