#include "cc/transport/stream/stream_connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/peer_errors.h"
#include "cc/transport/stream/socket_io.h"

namespace tf_rdma {
namespace {

// Messages up to this size are sent from the caller's thread when the socket takes them at once.
constexpr uint64_t kInlineMessageLimit = 64 << 10;

}  // namespace

StreamConnection::StreamConnection(int fd, Backend backend, std::string peer_name,
                                   std::string peer_address, const TransportOptions& options)
    : fd_(fd),
      backend_(backend),
      peer_name_(std::move(peer_name)),
      peer_address_(std::move(peer_address)),
      options_(options) {}

StreamConnection::~StreamConnection() {
  for (int fd : received_fds_) close(fd);
  close(fd_);
}

void StreamConnection::Start() {
  absl::Status status = SetReceiveTimeout(fd_, options_.peer_timeout);
  if (!status.ok()) {
    CloseInternal(status, false);
    return;
  }
  std::thread([self = shared_from_this()] { self->ReadLoop(); }).detach();
  std::thread([self = shared_from_this()] { self->WriteLoop(); }).detach();
}

absl::Status StreamConnection::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

uint64_t StreamConnection::Grant(const Tag& tag, std::shared_ptr<MemoryRegion> region,
                                 uint64_t offset, uint64_t capacity, GrantDone done) {
  if (region == nullptr || offset > region->size() || capacity > region->size() - offset) {
    done({absl::InvalidArgumentError(absl::StrCat(
              "grant of [", offset, ", +", capacity, ") does not fit in region of ",
              region ? region->size() : 0, " bytes")),
          0});
    return 0;
  }
  absl::Status usable = CheckLocalRegion(*region);
  if (!usable.ok()) {
    done({usable, 0});
    return 0;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) {
    absl::Status status = status_;
    lock.unlock();
    done({status, 0});
    return 0;
  }
  const uint64_t id = next_grant_id_++;
  std::optional<ControlFrame> before = FrameBeforeGrant(region);
  if (before) EnqueueLocked(Outgoing{std::move(before)});
  wire::Grant grant{id, tag, region->id(), offset, capacity};
  local_grants_.emplace(id, LocalGrant{tag, std::move(region), offset, capacity, std::move(done)});
  EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kGrant, grant}}});
  FlushLocked(lock);
  return id;
}

void StreamConnection::Revoke(uint64_t grant_id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = local_grants_.find(grant_id);
  if (it == local_grants_.end() || it->second.revoking || !status_.ok()) return;
  it->second.revoking = true;
  EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kRevoke, wire::Revoke{grant_id}}}});
  FlushLocked(lock);
}

void StreamConnection::Write(const Tag& tag, const void* src, uint64_t length, WriteDone done) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) {
    absl::Status status = status_;
    lock.unlock();
    done(status);
    return;
  }
  PendingWrite write{src, length, std::move(done)};
  auto grants = remote_grants_.find(tag);
  while (grants != remote_grants_.end() && !grants->second.empty()) {
    wire::Grant grant = grants->second.front();
    grants->second.pop_front();
    remote_grant_ids_.erase(grant.grant_id);
    if (grants->second.empty()) remote_grants_.erase(grants);
    if (TryPairLocked(grant, write)) {
      FlushLocked(lock);
      return;
    }
    grants = remote_grants_.find(tag);
  }
  pending_writes_[tag].push_back(std::move(write));
  FlushLocked(lock);
}

bool StreamConnection::TryPairLocked(const wire::Grant& grant, const PendingWrite& write) {
  if (grant.capacity < write.length) {
    EnqueueLocked(Outgoing{ControlFrame{
        {wire::FrameType::kTooSmall, wire::TooSmall{grant.grant_id, write.length}}}});
    return false;
  }
  EnqueueLocked(Outgoing{std::nullopt, grant, write});
  return true;
}

void StreamConnection::EnqueueLocked(Outgoing item) { outgoing_.push_back(std::move(item)); }

void StreamConnection::Close(const absl::Status& reason) {
  CloseInternal(reason.ok() ? absl::CancelledError("connection closed") : reason, true);
}

void StreamConnection::CloseInternal(const absl::Status& reason, bool tell_peer) {
  std::vector<GrantDone> grants;
  std::vector<WriteDone> writes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return;
    status_ = reason;
    for (auto& [id, grant] : local_grants_) grants.push_back(std::move(grant.done));
    local_grants_.clear();
    for (auto& [tag, queue] : pending_writes_) {
      for (auto& write : queue) writes.push_back(std::move(write.done));
    }
    pending_writes_.clear();
    remote_grants_.clear();
    remote_grant_ids_.clear();
    writer_wakeup_.notify_one();
  }
  // The peer learns why, once the frame being sent (if any) is out; a sender stuck on a peer that
  // reads nothing is not waited for long.
  if (tell_peer && send_mu_.try_lock_for(std::chrono::milliseconds(200))) {
    std::string bytes = wire::Encode(
        {wire::FrameType::kReject,
         wire::Reject{static_cast<uint32_t>(reason.code()), std::string(reason.message())}});
    send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    send_mu_.unlock();
  }
  shutdown(fd_, SHUT_RDWR);
  if (!reason.ok() && reason.code() != absl::StatusCode::kCancelled) {
    LOG(WARNING) << "tf_rdma: " << BackendName(backend_) << " connection to " << peer_name_
                 << " at " << peer_address_ << " closed: " << reason;
  }
  for (auto& done : grants) done({reason, 0});
  for (auto& done : writes) done(reason);
}

absl::Status StreamConnection::PeerError(const absl::Status& cause) const {
  return PeerFailure(peer_name_, peer_address_, cause);
}

void StreamConnection::ReadLoop() {
  while (true) {
    absl::StatusOr<wire::Frame> frame = ReceiveFrame(fd_, &received_fds_);
    if (frame.ok() && frame->type == wire::FrameType::kReject) {
      const auto& reject = std::get<wire::Reject>(frame->body);
      CloseInternal(PeerClosedConnection(peer_name_, peer_address_, reject.code, reject.message), false);
      return;
    }
    absl::Status status = frame.ok() ? Dispatch(std::move(*frame)) : frame.status();
    if (!status.ok()) {
      CloseInternal(PeerError(status), status.code() == absl::StatusCode::kDataLoss);
      return;
    }
  }
}

absl::Status StreamConnection::Dispatch(wire::Frame frame) {
  switch (frame.type) {
    case wire::FrameType::kPing:
      return absl::OkStatus();
    case wire::FrameType::kGrant:
      return OnRemoteGrant(std::get<wire::Grant>(frame.body));
    case wire::FrameType::kData:
      return OnData(std::get<wire::Data>(frame.body));
    case wire::FrameType::kTooSmall: {
      const auto& too_small = std::get<wire::TooSmall>(frame.body);
      return OnGrantReturned(
          too_small.grant_id,
          {absl::ResourceExhaustedError(absl::StrCat("the message needs ", too_small.needed,
                                                     " bytes, more than granted")),
           too_small.needed},
          true);
    }
    case wire::FrameType::kRevoke:
      OnPeerRevoke(std::get<wire::Revoke>(frame.body).grant_id);
      return absl::OkStatus();
    case wire::FrameType::kRevoked:
      return OnGrantReturned(std::get<wire::Revoked>(frame.body).grant_id,
                             {absl::CancelledError("grant revoked"), 0}, false);
    case wire::FrameType::kShmRegion: {
      int fd = -1;
      if (!received_fds_.empty()) {
        fd = received_fds_.front();
        received_fds_.pop_front();
      }
      return OnShmRegion(std::get<wire::ShmRegion>(frame.body), fd);
    }
    default:
      return absl::DataLossError(absl::StrCat("unexpected ", wire::FrameTypeName(frame.type),
                                              " frame after the handshake"));
  }
}

absl::Status StreamConnection::OnShmRegion(const wire::ShmRegion&, int fd) {
  if (fd >= 0) close(fd);
  return absl::DataLossError(absl::StrCat("SHM_REGION frame on a ", BackendName(backend_),
                                          " connection"));
}

absl::Status StreamConnection::OnRemoteGrant(const wire::Grant& grant) {
  absl::Status usable = CheckRemoteGrant(grant);
  if (!usable.ok()) return usable;
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) return absl::OkStatus();
  if (!remote_grant_ids_.insert(grant.grant_id).second) {
    return absl::DataLossError(absl::StrCat("grant id ", grant.grant_id, " granted twice"));
  }
  auto writes = pending_writes_.find(grant.tag);
  if (writes != pending_writes_.end()) {
    remote_grant_ids_.erase(grant.grant_id);
    if (TryPairLocked(grant, writes->second.front())) {
      writes->second.pop_front();
      if (writes->second.empty()) pending_writes_.erase(writes);
    }
    FlushLocked(lock);
    return absl::OkStatus();
  }
  remote_grants_[grant.tag].push_back(grant);
  return absl::OkStatus();
}

void StreamConnection::OnPeerRevoke(uint64_t grant_id) {
  std::unique_lock<std::mutex> lock(mu_);
  // A grant already used is answered by its DATA or TOO_SMALL, which the peer handles.
  if (remote_grant_ids_.erase(grant_id) == 0) return;
  for (auto it = remote_grants_.begin(); it != remote_grants_.end(); ++it) {
    auto& queue = it->second;
    for (auto g = queue.begin(); g != queue.end(); ++g) {
      if (g->grant_id != grant_id) continue;
      queue.erase(g);
      if (queue.empty()) remote_grants_.erase(it);
      EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kRevoked, wire::Revoked{grant_id}}}});
      FlushLocked(lock);
      return;
    }
  }
}

absl::Status StreamConnection::OnData(const wire::Data& data) {
  LocalGrant grant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = local_grants_.find(data.grant_id);
    if (it == local_grants_.end()) {
      return absl::DataLossError(absl::StrCat("DATA for grant ", data.grant_id,
                                              ", which is not outstanding"));
    }
    if (data.length > it->second.capacity) {
      return absl::DataLossError(absl::StrCat("DATA of ", data.length, " bytes for a grant of ",
                                              it->second.capacity));
    }
    // Taken out before the payload lands, so that Close cannot hand the range back meanwhile.
    grant = std::move(it->second);
    local_grants_.erase(it);
  }
  const absl::Status landed = ReceiveMessage(grant.region->data() + grant.offset, data.length);
  if (landed.ok()) {
    grant.done({landed, data.length});
  } else {
    const absl::Status closed = health();
    grant.done({closed.ok() ? PeerError(landed) : closed, 0});
  }
  return landed;
}

absl::Status StreamConnection::OnGrantReturned(uint64_t grant_id, GrantResult result,
                                               bool must_exceed_capacity) {
  GrantDone done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = local_grants_.find(grant_id);
    if (it == local_grants_.end()) {
      return absl::DataLossError(absl::StrCat("grant ", grant_id, " returned but not outstanding"));
    }
    if (must_exceed_capacity && result.length <= it->second.capacity) {
      return absl::DataLossError(absl::StrCat("TOO_SMALL for a message of ", result.length,
                                              " bytes that fits the grant of ", it->second.capacity));
    }
    done = std::move(it->second.done);
    local_grants_.erase(it);
  }
  done(result);
  return absl::OkStatus();
}

bool StreamConnection::Cheap(const Outgoing& item) {
  if (item.remainder) return false;
  if (item.control) return item.control->pass_fd < 0;
  return item.write.length <= kInlineMessageLimit;
}

void StreamConnection::FlushLocked(std::unique_lock<std::mutex>& lock) {
  if (sending_ || send_broken_ || outgoing_.empty()) return;
  if (Cheap(outgoing_.front()) && status_.ok()) {
    sending_ = true;
    while (!outgoing_.empty() && Cheap(outgoing_.front()) && status_.ok() && !send_broken_) {
      Outgoing item = std::move(outgoing_.front());
      outgoing_.pop_front();
      lock.unlock();
      Transmit(std::move(item), /*nonblocking=*/true);
      lock.lock();
    }
    sending_ = false;
  }
  if (!outgoing_.empty() || !status_.ok()) writer_wakeup_.notify_one();
}

void StreamConnection::Transmit(Outgoing item, bool nonblocking) {
  std::string head;
  const void* payload = nullptr;
  uint64_t payload_length = 0;
  int pass_fd = -1;
  absl::Status failure;
  if (item.remainder) {
    head = std::move(*item.remainder);
  } else if (item.control) {
    head = wire::Encode(item.control->frame);
    pass_fd = item.control->pass_fd;
  } else {
    absl::StatusOr<bool> payload_follows = PlaceMessage(item.grant, item.write.src, item.write.length);
    failure = payload_follows.status();
    head = wire::Encode({wire::FrameType::kData, wire::Data{item.grant.grant_id, item.write.length}});
    if (payload_follows.ok() && *payload_follows) {
      payload = item.write.src;
      payload_length = item.write.length;
    }
  }
  if (failure.ok()) {
    std::vector<iovec> iov{{head.data(), head.size()}};
    if (payload_length > 0) iov.push_back({const_cast<void*>(payload), payload_length});
    std::unique_lock<std::timed_mutex> send_lock(send_mu_);
    if (!nonblocking) {
      failure = SendAll(fd_, std::move(iov), pass_fd);
    } else {
      absl::StatusOr<size_t> sent = SendWithoutBlocking(fd_, iov, pass_fd);
      failure = sent.status();
      const size_t total = head.size() + payload_length;
      if (sent.ok() && *sent < total) {
        send_lock.unlock();
        std::string rest;
        rest.reserve(total - *sent);
        if (*sent < head.size()) rest.append(head, *sent, std::string::npos);
        const size_t payload_sent = *sent > head.size() ? *sent - head.size() : 0;
        rest.append(static_cast<const char*>(payload) + payload_sent, payload_length - payload_sent);
        Outgoing later;
        later.remainder = std::move(rest);
        later.write.done = std::move(item.write.done);
        std::lock_guard<std::mutex> lock(mu_);
        outgoing_.push_front(std::move(later));
        return;
      }
    }
  }
  if (failure.ok()) {
    if (item.write.done) item.write.done(failure);
    return;
  }
  const absl::Status closed = health();
  if (item.write.done) item.write.done(closed.ok() ? PeerError(failure) : closed);
  if (closed.ok()) {
    // The peer most likely closed first, and its reason (a REJECT frame) may still wait in the
    // receive buffer: stop sending and let the reader end the connection with that reason. The
    // FIN makes the peer close its side if it had not, so the reader ends promptly either way.
    std::lock_guard<std::mutex> lock(mu_);
    send_broken_ = true;
    shutdown(fd_, SHUT_WR);
  }
}

void StreamConnection::WriteLoop() {
  // Beats well inside the peer's silence limit.
  const absl::Duration beat = options_.peer_timeout / 4;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    const bool work = writer_wakeup_.wait_for(lock, absl::ToChronoMilliseconds(beat), [&] {
      return (!outgoing_.empty() && !sending_ && !send_broken_) || !status_.ok();
    });
    if (!status_.ok()) {
      std::vector<WriteDone> failed;
      for (auto& queued : outgoing_) {
        if (!queued.control && queued.write.done) failed.push_back(std::move(queued.write.done));
      }
      outgoing_.clear();
      const absl::Status status = status_;
      lock.unlock();
      for (auto& done : failed) done(status);
      return;
    }
    if (sending_ || send_broken_) continue;
    Outgoing item;
    if (work) {
      item = std::move(outgoing_.front());
      outgoing_.pop_front();
    } else {
      item.control = ControlFrame{{wire::FrameType::kPing, wire::Ping{}}};
    }
    sending_ = true;
    lock.unlock();
    Transmit(std::move(item), /*nonblocking=*/false);
    lock.lock();
    sending_ = false;
  }
}

absl::Status StreamConnection::ReceiveRaw(char* dst, uint64_t length) {
  return ReceiveExact(fd_, dst, length, &received_fds_);
}

}  // namespace tf_rdma
