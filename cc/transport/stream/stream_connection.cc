#include "cc/transport/stream/stream_connection.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <climits>
#include <exception>
#include <new>
#include <system_error>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/peer_errors.h"
#include "cc/transport/stream/socket_io.h"

namespace tf_rdma {
namespace {

// Messages up to this size are sent from the caller's thread when the socket takes them at once.
constexpr uint64_t kInlineMessageLimit = 64 << 10;
// Frames (or payload pieces) one readable event acts on, and items one writable event sends,
// before the loop serves its other connections: a busy peer cannot starve them.
constexpr int kReadsPerEvent = 64;
constexpr int kSendsPerEvent = 16;
// Message bytes one readable event moves or lets go (ReadAvailable) before the loop serves its
// other connections. Without it a peer on another core answers each grant or DATA frame while its
// turn still runs, and that one connection cycles grant -> data -> grant up to kReadsPerEvent
// times in a turn where the others move what they had queued: at 256 peers writing 64 KiB
// messages, the least served moved a fifth of the most served. A few messages' worth keeps a
// single busy peer's extra cost at one epoll_wait per quantum. The turn may end with frames in
// the reader's buffer and none in the socket: the loop calls again after kMore whatever event
// comes next (io_loops.h).
constexpr uint64_t kBytesPerTurn = 256 << 10;
// What one send syscall gathers: items, two iovecs each (a head and the payload on the stream),
// and message bytes, as a readable turn's.
constexpr size_t kIovecsPerSend = IOV_MAX;
constexpr uint64_t kBytesPerSend = kBytesPerTurn;

// The connection whose events this thread (its I/O loop's) handles right now: frames it queues
// meanwhile, from the callbacks it runs too (a grant given again, a reply), wait until the handling
// returns and then leave together in one send, so the peer wakes once for them, not once per frame.
thread_local const StreamConnection* handling_events_of = nullptr;

}  // namespace

StreamConnection::StreamConnection(int fd, Backend backend, const PeerIdentity& peer,
                                   std::string peer_address, const TransportOptions& options)
    : fd_(fd),
      backend_(backend),
      peer_name_(peer.name),
      peer_build_(peer.build),
      peer_address_(std::move(peer_address)),
      options_(options) {}

StreamConnection::~StreamConnection() {
  for (int fd : received_fds_) close(fd);
  if (fd_ >= 0) close(fd_);
}

absl::Status StreamConnection::Start(std::shared_ptr<IoLoop> loop) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_ = loop;
  }
  last_heard_ = last_sent_ = absl::Now();
  absl::Status status = loop->Add(fd_, shared_from_this());
  if (!status.ok()) {
    status = absl::Status(status.code(), absl::StrCat("cannot serve the connection to ", peer_name_,
                                                      " at ", peer_address_, ": ", status.message()));
    CloseInternal(status, status);
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

void StreamConnection::DiscardPeerWrites(const Tag& tag) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) return;
  EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kDiscard, wire::Discard{tag}}}});
  FlushLocked(lock);
}

void StreamConnection::EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing) {
  for (const wire::TooSmall& too_small : pairing.too_small) {
    EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kTooSmall, too_small}}});
  }
  for (wire::Withdrawn& withdrawn : pairing.withdrawn) {
    EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kWithdrawn, std::move(withdrawn)}}});
  }
  if (pairing.ready) {
    EnqueueLocked(Outgoing{std::nullopt, pairing.ready->first, std::move(pairing.ready->second)});
  }
}

void StreamConnection::EnqueueLocked(Outgoing item) { outgoing_.push_back(std::move(item)); }

void StreamConnection::Close(const absl::Status& reason) {
  const absl::Status closed = reason.ok() ? absl::CancelledError("connection closed") : reason;
  CloseInternal(closed, closed);
}

void StreamConnection::CloseInternal(const absl::Status& reason, const std::optional<absl::Status>& told_peer) {
  std::vector<GrantDone> grants;
  std::vector<WriteDone> writes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return;
    status_ = reason;
    for (auto& grant : book_.TakeAllIssued()) grants.push_back(std::move(grant.done));
    for (auto& write : book_.TakeAllWaiting()) writes.push_back(std::move(write.done));
    for (auto& queued : outgoing_) {
      if (!queued.control && queued.write.done) writes.push_back(std::move(queued.write.done));
    }
    outgoing_.clear();
    WatchWritableLocked(false);
  }
  {
    // The peer learns why, once the frame being sent (if any) is out.
    std::lock_guard<std::mutex> send_lock(send_mu_);
    if (fd_ >= 0) {
      if (told_peer) {
        std::string bytes = wire::Encode(
            {wire::FrameType::kReject,
             wire::Reject{static_cast<uint32_t>(told_peer->code()), std::string(told_peer->message())}});
        send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      shutdown(fd_, SHUT_RDWR);
    }
  }
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

IoHandler::Progress StreamConnection::OnEvents(uint32_t events) {
  bool more = false;
  const StreamConnection* const outer = handling_events_of;
  handling_events_of = this;
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) more = ReadAvailable();
  if (events & EPOLLOUT) SendQueued();
  handling_events_of = outer;
  {
    std::unique_lock<std::mutex> lock(mu_);
    FlushLocked(lock);
  }
  if (health().ok()) return more ? Progress::kMore : Progress::kWaiting;
  Finish();
  return Progress::kFinished;
}

bool StreamConnection::OnTick(absl::Time now) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) {
    lock.unlock();
    Finish();
    return false;
  }
  if (heard_since_tick_) {
    heard_since_tick_ = false;
    last_heard_ = now;
  } else if (now - last_heard_ < options_.peer_timeout) {
    // Quiet for a tick: the receive buffer goes back, so an idle peer costs none. (Not after each
    // read: its pages would fault in again for every message, a cost that shows in latency.)
    reader_.ReleaseIfDrained();
  } else if (UnreadBytesWaiting()) {
    last_heard_ = now;  // this process was stopped or starved: the loop reads them next
  } else {
    // Told, so that a peer that was stopped, starved or cut off and runs again knows the failure
    // is its own, not ours (PeerFoundThisProcessSilent).
    const absl::Duration silence = now - last_heard_;
    lock.unlock();
    CloseInternal(PeerError(absl::DeadlineExceededError(absl::StrCat(
                      "the peer sent nothing for ", absl::ToInt64Milliseconds(silence), " ms"))),
                  WentSilentReason(silence));
    Finish();
    return false;
  }
  std::vector<ControlFrame> gone = FramesForGoneRegionsLocked();
  for (ControlFrame& frame : gone) EnqueueLocked(Outgoing{std::move(frame)});
  if (!gone.empty()) FlushLocked(lock);
  // Beats well inside the peer's silence limit, when nothing else went out meanwhile.
  if (sent_since_tick_.exchange(false, std::memory_order_relaxed)) {
    last_sent_ = now;
  } else if (now - last_sent_ >= options_.peer_timeout / 4 && outgoing_.empty()) {
    last_sent_ = now;
    EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kPing, wire::Ping{}}}});
    FlushLocked(lock);
  }
  return true;
}

bool StreamConnection::UnreadBytesWaiting() const {
  char byte;
  // 0 is the peer's FIN, also unread news from it.
  return fd_ >= 0 && recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) >= 0;
}

void StreamConnection::OnLoopStopped() {
  const absl::Status stopped = absl::CancelledError("the local tf_rdma transport shut down");
  CloseInternal(stopped, stopped);
  Finish();
}

void StreamConnection::OnRemoved() {
  // Closed, not made to point elsewhere (dup2 of a placeholder): that would keep one descriptor
  // per dead connection for as long as users hold it. Closing is safe because every other use of
  // fd_ holds send_mu_ (sends, shutdowns) or mu_ (the loop's writability watch) and skips it once
  // it is -1; the reader and the frame at hand's descriptors belong to the loop's thread, which
  // is done with the connection. Callers then get the connection's error, which was set before
  // the loop let go of it.
  reader_.Release();
  for (int fd : received_fds_) close(fd);
  received_fds_.clear();
  std::lock_guard<std::mutex> send_lock(send_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  close(fd_);
  fd_ = -1;
}

void StreamConnection::Finish() {
  if (!payload_) return;
  const absl::Status closed = health();
  payload_->grant.done({closed, 0});
  payload_.reset();
}

bool StreamConnection::ReadAvailable() {
  reader_.OnReadable();
  heard_since_tick_ = true;
  moved_this_turn_ = 0;
  for (int step = 0; step < kReadsPerEvent && moved_this_turn_ < kBytesPerTurn; ++step) {
    bool progressed = false;
    const absl::Status status = ReadStep(&progressed);
    if (!status.ok()) {
      // The peer learns why when the cause is ours to state: its protocol error, or our limit.
      const absl::Status failure = PeerError(status);
      const bool ours_to_state = status.code() == absl::StatusCode::kDataLoss ||
                                 status.code() == absl::StatusCode::kResourceExhausted;
      CloseInternal(failure, ours_to_state ? std::optional<absl::Status>(failure) : std::nullopt);
      return false;
    }
    if (!progressed) return false;
  }
  return true;  // the budget ran out: what was read (or is still in the socket) comes next call
}

absl::Status StreamConnection::ReadStep(bool* progressed) {
  // A peer's frames allocate (its grants, regions, tags): when the process runs out of memory,
  // that connection fails instead of the exception ending the process.
  try {
    return payload_ ? ReceivePayload(progressed) : ReadAndDispatch(progressed);
  } catch (const std::bad_alloc&) {
    // The peer's grants go first: failing the connection allocates (its error, the log line).
    std::lock_guard<std::mutex> lock(mu_);
    book_.ForgetPeerGrants();
    return absl::ResourceExhaustedError(
        "out of memory handling the peer's frames (RLIMIT_AS, or the host's memory)");
  }
}

absl::Status StreamConnection::ReceivePayload(bool* progressed) {
  absl::StatusOr<size_t> got =
      reader_.ReadSome(payload_->dst + payload_->received, payload_->length - payload_->received);
  absl::Status status = got.status();
  if (status.ok()) {
    *progressed = *got > 0;
    payload_->received += *got;
    moved_this_turn_ += *got;
    // A payload read off the stream must not bring descriptors either.
    CollectDescriptors();
    status = RefuseStrayDescriptors(0, "DATA");
  }
  if (!status.ok()) {
    const absl::Status closed = health();
    payload_->grant.done({closed.ok() ? PeerError(status) : closed, 0});
    payload_.reset();
    return status;
  }
  if (payload_->received == payload_->length) {
    IncomingPayload landed = *std::move(payload_);
    payload_.reset();
    landed.grant.done({absl::OkStatus(), landed.length});
  }
  return absl::OkStatus();
}

absl::Status StreamConnection::ReadAndDispatch(bool* progressed) {
  absl::StatusOr<std::optional<wire::Frame>> next = reader_.NextFrame();
  CollectDescriptors();
  if (next.ok() && !next->has_value()) return absl::OkStatus();
  *progressed = true;
  if (!next.ok()) return next.status();
  wire::Frame frame = **std::move(next);
  if (frame.type == wire::FrameType::kReject) {
    // The peer's own reason ends the connection, not a failure of ours (ReadAvailable's close of
    // it then finds the connection closed already).
    const auto& reject = std::get<wire::Reject>(frame.body);
    const absl::Status closed = PeerClosedConnection(peer_name_, peer_address_, reject.code, reject.message);
    CloseInternal(closed, std::nullopt);
    return closed;
  }
  const char* type = wire::FrameTypeName(frame.type);
  absl::Status status = RefuseStrayDescriptors(frame.type == wire::FrameType::kShmRegion ? 1 : 0, type);
  if (status.ok()) status = Dispatch(std::move(frame));
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
      return OnGrantReturned(too_small.grant_id, TooSmallResult(too_small), true);
    }
    case wire::FrameType::kRevoke:
      OnPeerRevoke(std::get<wire::Revoke>(frame.body).grant_id);
      return absl::OkStatus();
    case wire::FrameType::kRevoked:
      return OnGrantReturned(std::get<wire::Revoked>(frame.body).grant_id,
                             {absl::CancelledError("grant revoked"), 0}, false);
    case wire::FrameType::kDiscard:
      OnPeerDiscard(std::get<wire::Discard>(frame.body).tag);
      return absl::OkStatus();
    case wire::FrameType::kWithdrawn:
      return OnWithdrawn(std::get<wire::Withdrawn>(frame.body));
    case wire::FrameType::kShmRegion: {
      int fd = -1;
      if (!received_fds_.empty()) {
        fd = received_fds_.front();
        received_fds_.pop_front();
      }
      return OnShmRegion(std::get<wire::ShmRegion>(frame.body), fd);
    }
    case wire::FrameType::kShmRegionGone:
      return OnShmRegionGone(std::get<wire::ShmRegionGone>(frame.body));
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

absl::Status StreamConnection::OnShmRegionGone(const wire::ShmRegionGone&) {
  return absl::DataLossError(absl::StrCat("SHM_REGION_GONE frame on a ", BackendName(backend_), " connection"));
}

absl::Status StreamConnection::OnRemoteGrant(const wire::Grant& grant) {
  absl::Status usable = CheckRemoteGrant(grant);
  if (!usable.ok()) return usable;
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) return absl::OkStatus();
  absl::StatusOr<GrantBook<PendingWrite>::Pairing> pairing = book_.OnPeerGrant(grant);
  if (!pairing.ok()) return pairing.status();
  // The message the grant lets go, not its capacity: a grant larger than what is sent into it (or
  // that no write waits for yet) must not end the turn early.
  if (pairing->ready) moved_this_turn_ += pairing->ready->second.length;
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

void StreamConnection::OnPeerDiscard(const Tag& tag) {
  std::vector<PendingWrite> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped = book_.DiscardWrites(tag);
  }
  for (auto& write : dropped) write.done(DiscardedWrite());
}

void StreamConnection::Withdraw(const Tag& tag, const absl::Status& why) {
  GrantBook<PendingWrite>::Withdrawal withdrawal;
  {
    std::unique_lock<std::mutex> lock(mu_);
    withdrawal = book_.Withdraw(tag, why);
    if (status_.ok()) {
      for (wire::Withdrawn& answer : withdrawal.withdrawn) {
        EnqueueLocked(Outgoing{ControlFrame{{wire::FrameType::kWithdrawn, std::move(answer)}}});
      }
      FlushLocked(lock);
    }
  }
  for (auto& write : withdrawal.writes) write.done(DiscardedWrite());
}

absl::Status StreamConnection::OnWithdrawn(const wire::Withdrawn& withdrawn) {
  absl::StatusOr<IssuedGrant> grant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    grant = book_.TakeWithdrawn(withdrawn.grant_id);
  }
  if (!grant.ok()) return grant.status();
  grant->done({PeerWithdrewMessage(peer_name_, peer_address_, withdrawn.code, withdrawn.reason), 0});
  return absl::OkStatus();
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
  if (PayloadOnStream() && data.length > 0) {
    char* dst = grant->region->data() + grant->offset;
    payload_ = IncomingPayload{*std::move(grant), dst, data.length};
    return absl::OkStatus();  // its bytes count as they come off the stream
  }
  moved_this_turn_ += data.length;
  grant->done({absl::OkStatus(), data.length});
  return absl::OkStatus();
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
  if (item.started) return false;
  if (item.control) return item.control->pass_fd < 0;
  return item.write.length <= kInlineMessageLimit;
}

void StreamConnection::FlushLocked(std::unique_lock<std::mutex>& lock) {
  if (handling_events_of == this) return;  // OnEvents sends it when the handling returns
  if (sending_ || send_broken_ || outgoing_.empty() || !status_.ok()) return;
  sending_ = true;
  while (!outgoing_.empty() && Cheap(outgoing_.front()) && status_.ok() && !send_broken_) {
    OutgoingBatch batch = TakeBatchLocked(/*cheap_only=*/true);
    lock.unlock();
    const bool all_sent = Transmit(std::move(batch));
    lock.lock();
    if (!all_sent) break;
  }
  sending_ = false;
  if (!outgoing_.empty() && status_.ok() && !send_broken_) WatchWritableLocked(true);
}

void StreamConnection::SendQueued() {
  std::unique_lock<std::mutex> lock(mu_);
  for (int sends = 0; sends < kSendsPerEvent; ++sends) {
    if (outgoing_.empty() || sending_ || send_broken_ || !status_.ok()) break;
    OutgoingBatch batch = TakeBatchLocked(/*cheap_only=*/false);
    sending_ = true;
    lock.unlock();
    const bool all_sent = Transmit(std::move(batch));
    lock.lock();
    sending_ = false;
    if (!all_sent) return;  // the socket is full: the next writable event goes on
  }
  // Whoever holds the send side now watches for writability again if it leaves something behind.
  const bool more = !outgoing_.empty() && !sending_ && !send_broken_ && status_.ok();
  WatchWritableLocked(more);
}

StreamConnection::OutgoingBatch StreamConnection::TakeBatchLocked(bool cheap_only) {
  OutgoingBatch batch;
  uint64_t bytes = 0;
  while (!outgoing_.empty() && 2 * (batch.size() + 1) <= kIovecsPerSend && bytes < kBytesPerSend) {
    const Outgoing& next = outgoing_.front();
    if (cheap_only && !Cheap(next)) break;
    // A descriptor goes in a send of its own: the peer's receive ends with the send that passed
    // it and charges it to the frame it ended with (StreamReader::TakeDescriptors).
    const bool passes_fd = next.control && next.control->pass_fd >= 0 && next.sent == 0;
    if (passes_fd && !batch.empty()) break;
    if (!next.control) bytes += next.write.length;
    batch.push_back(std::move(outgoing_.front()));
    outgoing_.pop_front();
    if (passes_fd) break;
  }
  return batch;
}

absl::Status StreamConnection::Prepare(Outgoing& item) {
  if (item.started) return absl::OkStatus();
  if (item.control) {
    item.head = wire::Encode(item.control->frame);
    item.started = true;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> payload_follows = PlaceMessage(item.grant, item.write.src, item.write.length);
  if (!payload_follows.ok()) return payload_follows.status();
  item.started = true;
  item.head = wire::Encode({wire::FrameType::kData, wire::Data{item.grant.grant_id, item.write.length}});
  if (*payload_follows) {
    item.payload = static_cast<const char*>(item.write.src);
    item.payload_length = item.write.length;
  }
  return absl::OkStatus();
}

bool StreamConnection::RequeueFront(OutgoingBatch& batch, size_t from) {
  if (from >= batch.size()) return true;
  std::unique_lock<std::mutex> lock(mu_);
  if (status_.ok()) {
    for (size_t i = batch.size(); i > from; --i) outgoing_.push_front(std::move(batch[i - 1]));
    batch.resize(from);
    return true;
  }
  // Closed meanwhile: the rest will never go.
  const absl::Status closed = status_;
  lock.unlock();
  for (size_t i = from; i < batch.size(); ++i) {
    if (batch[i].write.done) batch[i].write.done(closed);
  }
  batch.resize(from);
  return false;
}

bool StreamConnection::Transmit(OutgoingBatch batch) {
  absl::Status failure;
  size_t prepared = 0;
  while (prepared < batch.size() && failure.ok()) {
    failure = Prepare(batch[prepared]);
    if (failure.ok()) ++prepared;
  }
  if (!failure.ok() && prepared > 0) {
    // What was prepared goes now; the item that failed comes first in the next send, and fails
    // there on its own.
    failure = absl::OkStatus();
    RequeueFront(batch, prepared);
  } else if (!failure.ok()) {
    RequeueFront(batch, 1);
  }
  if (failure.ok()) {
    std::vector<iovec> iov;
    for (Outgoing& item : batch) {
      if (item.sent < item.head.size()) {
        iov.push_back({item.head.data() + item.sent, item.head.size() - item.sent});
      }
      const uint64_t payload_sent = item.sent > item.head.size() ? item.sent - item.head.size() : 0;
      if (item.payload_length > payload_sent) {
        iov.push_back({const_cast<char*>(item.payload) + payload_sent, item.payload_length - payload_sent});
      }
    }
    // The descriptor rides on the item's first byte (TakeBatchLocked sends it alone).
    const Outgoing& first = batch.front();
    const int pass_fd = first.sent == 0 && first.control ? first.control->pass_fd : -1;
    absl::StatusOr<size_t> sent;
    {
      std::lock_guard<std::mutex> send_lock(send_mu_);
      // Closed: the connection failed already, and its error is what the writes get below.
      sent = fd_ >= 0 ? SendWithoutBlocking(fd_, iov, pass_fd)
                      : absl::StatusOr<size_t>(absl::UnavailableError("the socket is closed"));
    }
    failure = sent.status();
    if (sent.ok()) {
      if (*sent > 0) sent_since_tick_.store(true, std::memory_order_relaxed);
      uint64_t left = *sent;
      size_t done = 0;
      for (; done < batch.size(); ++done) {
        Outgoing& item = batch[done];
        const uint64_t rest = item.head.size() + item.payload_length - item.sent;
        if (left < rest) {
          item.sent += left;
          break;
        }
        left -= rest;
        item.sent += rest;
      }
      const bool all_sent = done == batch.size();
      // What did not go waits at the front of the queue, for the loop.
      const bool requeued = RequeueFront(batch, done);
      for (Outgoing& item : batch) {
        if (item.write.done) item.write.done(absl::OkStatus());
      }
      return all_sent || !requeued;
    }
  }
  const absl::Status closed = health();
  for (Outgoing& item : batch) {
    if (item.write.done) item.write.done(closed.ok() ? PeerError(failure) : closed);
  }
  if (closed.ok()) {
    // The peer most likely closed first, and its reason (a REJECT frame) may still wait in the
    // receive buffer: stop sending and let the loop end the connection with that reason. The
    // FIN makes the peer close its side if it had not, so the loop ends it promptly either way.
    std::lock_guard<std::mutex> lock(mu_);
    send_broken_ = true;
    WatchWritableLocked(false);
    if (fd_ >= 0) shutdown(fd_, SHUT_WR);
  }
  return true;
}

void StreamConnection::WatchWritableLocked(bool writable) {
  if (writable == writable_watched_ || !loop_ || fd_ < 0) return;
  writable_watched_ = writable;
  loop_->WatchWritable(fd_, this, writable);
}

}  // namespace tf_rdma
