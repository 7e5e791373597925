#include "cc/transport/stream/stream_connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <new>
#include <system_error>
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

absl::Status StreamConnection::Start() {
  absl::Status status = SetReceiveTimeout(fd_, options_.peer_timeout);
  if (!status.ok()) {
    CloseInternal(status, false);
    return status;
  }
  // Under a pids limit or without address space for a stack, a peer's connection fails, not the
  // process. A reader already started ends once CloseInternal shut the socket down.
  try {
    std::thread([self = shared_from_this()] { self->ReadLoop(); }).detach();
    std::thread([self = shared_from_this()] { self->WriteLoop(); }).detach();
  } catch (const std::system_error& error) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("cannot start a thread for the connection to ", peer_name_, " at ",
                     peer_address_, ": ", error.what()));
    CloseInternal(status, true);
  }
  return status;
}

absl::Status StreamConnection::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

uint64_t StreamConnection::Grant(const Tag& tag, std::shared_ptr<MemoryRegion> region,
                                 uint64_t offset, uint64_t capacity, GrantDone done) {
  absl::Status usable = CheckGrantRange(region.get(), offset, capacity);
  if (usable.ok()) usable = CheckLocalRegion(*region);
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
  std::optional<ControlFrame> before = FrameBeforeGrant(region);
  if (before) EnqueueLocked(Outgoing{std::move(before)});
  const uint32_t region_id = region->id();
  const uint64_t id = book_.Issue(tag, std::move(region), offset, capacity, std::move(done));
  EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kGrant, wire::Grant{id, tag, region_id, offset, capacity}}}});
  FlushLocked(lock);
  return id;
}

void StreamConnection::Revoke(uint64_t grant_id) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok() || !book_.StartRevoke(grant_id)) return;
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
  GrantBook<PendingWrite>::Pairing pairing = book_.OnWrite(tag, PendingWrite{src, length, std::move(done)});
  if (pairing.discarded) {
    lock.unlock();
    pairing.discarded->done(DiscardedWrite());
    return;
  }
  EnqueuePairingLocked(std::move(pairing));
  FlushLocked(lock);
}

void StreamConnection::Discard(const Tag& tag) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) return;
  EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kDiscard, wire::Discard{tag}}}});
  FlushLocked(lock);
}

void StreamConnection::EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing) {
  for (const wire::TooSmall& too_small : pairing.too_small) {
    EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kTooSmall, too_small}}});
  }
  if (pairing.ready) {
    EnqueueLocked(Outgoing{std::nullopt, pairing.ready->first, std::move(pairing.ready->second)});
  }
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
    for (auto& grant : book_.TakeAllIssued()) grants.push_back(std::move(grant.done));
    for (auto& write : book_.TakeAllWaiting()) writes.push_back(std::move(write.done));
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
  // Throwing std::bad_alloc needs libstdc++'s per-thread exception state, which the loader
  // allocates on first use and, failing that, ends the process (_exit(127)). Used once now,
  // while the thread's creation shows there is memory, a later bad_alloc can be thrown and caught.
  // (Declared pure: only a volatile destination keeps the call from being optimized away.)
  volatile int exceptions_in_flight = std::uncaught_exceptions();
  (void)exceptions_in_flight;
  while (true) {
    absl::Status status = ReadOneFrame();
    if (!status.ok()) {
      // The peer learns why when the cause is ours to state: its protocol error, or our limit.
      CloseInternal(PeerError(status), status.code() == absl::StatusCode::kDataLoss ||
                                           status.code() == absl::StatusCode::kResourceExhausted);
      return;
    }
  }
}

absl::Status StreamConnection::ReadOneFrame() {
  // A peer's frames allocate (its grants, regions, tags): when the process runs out of memory,
  // that connection fails instead of the exception ending the process.
  try {
    return ReadAndDispatch();
  } catch (const std::bad_alloc&) {
    // The peer's grants go first: failing the connection allocates (its error, the log line).
    std::lock_guard<std::mutex> lock(mu_);
    book_.ForgetPeerGrants();
    return absl::ResourceExhaustedError(
        "out of memory handling the peer's frames (RLIMIT_AS, or the host's memory)");
  }
}

absl::Status StreamConnection::ReadAndDispatch() {
  absl::StatusOr<wire::Frame> frame = reader_.ReadFrame();
  CollectDescriptors();
  if (frame.ok() && frame->type == wire::FrameType::kReject) {
    // The peer's own reason ends the connection, not a failure of ours (ReadLoop's close of it
    // then finds the connection closed already).
    const auto& reject = std::get<wire::Reject>(frame->body);
    const absl::Status closed = PeerClosedConnection(peer_name_, peer_address_, reject.code, reject.message);
    CloseInternal(closed, false);
    return closed;
  }
  absl::Status status = frame.status();
  if (status.ok()) {
    const char* type = wire::FrameTypeName(frame->type);
    status = RefuseStrayDescriptors(frame->type == wire::FrameType::kShmRegion ? 1 : 0, type);
    if (status.ok()) status = Dispatch(std::move(*frame));
    // A payload read off the stream (tcp DATA) must not bring any either.
    CollectDescriptors();
    if (status.ok()) status = RefuseStrayDescriptors(0, type);
  }
  return status;
}

void StreamConnection::CollectDescriptors() {
  for (int fd : reader_.TakeDescriptors()) received_fds_.push_back(fd);
}

absl::Status StreamConnection::RefuseStrayDescriptors(size_t allowed, const char* frame_type) {
  if (received_fds_.size() <= allowed) return absl::OkStatus();
  const size_t count = received_fds_.size();
  for (int fd : received_fds_) close(fd);
  received_fds_.clear();
  // Said for the frame at hand: "only SHM_REGION carries one" reads as nonsense after SHM_REGION.
  return absl::DataLossError(absl::StrCat("the peer passed ", count, " file descriptor",
                                          count == 1 ? "" : "s", " with a ", frame_type, " frame",
                                          allowed == 0 ? "; only SHM_REGION carries one"
                                                       : ", which carries exactly one"));
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
    case wire::FrameType::kDiscard:
      Withdraw(std::get<wire::Discard>(frame.body).tag);  // the sender drops them alike
      return absl::OkStatus();
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
  absl::StatusOr<GrantBook<PendingWrite>::Pairing> pairing = book_.OnPeerGrant(grant);
  if (!pairing.ok()) return pairing.status();
  EnqueuePairingLocked(*std::move(pairing));
  FlushLocked(lock);
  return absl::OkStatus();
}

void StreamConnection::OnPeerRevoke(uint64_t grant_id) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!book_.OnPeerRevoke(grant_id)) return;
  EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kRevoked, wire::Revoked{grant_id}}}});
  FlushLocked(lock);
}

void StreamConnection::Withdraw(const Tag& tag) {
  std::vector<PendingWrite> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped = book_.Discard(tag);
  }
  for (auto& write : dropped) write.done(DiscardedWrite());
}

absl::Status StreamConnection::OnData(const wire::Data& data) {
  absl::StatusOr<IssuedGrant> grant;
  {
    // Taken out of the book before the payload lands, so that Close cannot hand the range back
    // meanwhile.
    std::lock_guard<std::mutex> lock(mu_);
    grant = book_.TakeFilled(data.grant_id, data.length);
  }
  if (!grant.ok()) return grant.status();
  const absl::Status landed = ReceiveMessage(grant->region->data() + grant->offset, data.length);
  if (landed.ok()) {
    grant->done({landed, data.length});
  } else {
    const absl::Status closed = health();
    grant->done({closed.ok() ? PeerError(landed) : closed, 0});
  }
  return landed;
}

absl::Status StreamConnection::OnGrantReturned(uint64_t grant_id, GrantResult result,
                                               bool must_exceed_capacity) {
  absl::StatusOr<IssuedGrant> grant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    grant = book_.TakeReturned(grant_id, must_exceed_capacity ? std::optional<uint64_t>(result.length)
                                                              : std::nullopt);
  }
  if (!grant.ok()) return grant.status();
  grant->done(result);
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
  return reader_.Read(dst, length);
}

}  // namespace tf_rdma
