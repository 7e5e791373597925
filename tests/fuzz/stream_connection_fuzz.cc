// A tcp or shm connection (cc/transport/stream/stream_connection.h and the shm backend's region
// book in cc/transport/shm/shm_transport.cc) driven event by event, on the fuzzer's thread, over a
// socketpair whose other end is a peer speaking fuzzed frames: grants into regions it shares (shm:
// memfds of any size, sealed or not, declared truthfully or not), said gone and shared again,
// DATA, TOO_SMALL, REVOKE, REVOKED, WITHDRAWN, DISCARD, raw bytes, stray descriptors; interleaved
// with this process's writes, grants, revokes, discards and give-ups, heartbeat ticks and writable
// events. Checked: nothing touches memory it should not (ASan: a write into a grant outside the
// peer's current mapping dies in memcpy), every frame the connection sends decodes, and once the
// connection ends every write and every grant has completed exactly once.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cc/transport/handshake.h"
#include "cc/transport/shm/shm_transport.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/stream/stream_connection.h"
#include "cc/transport/tcp/tcp_transport.h"
#include "cc/transport/wire.h"
#include "tests/fuzz/sent_frames.h"

namespace {

using tf_rdma::Tag;
using tf_rdma::wire::Frame;
using tf_rdma::wire::FrameType;

[[noreturn]] void Fail(const char* why) {
  __builtin_printf("stream_connection_fuzz: %s\n", why);
  std::abort();
}

constexpr uint64_t kMaxMessage = 256 << 10;
const char* SourceBytes() {
  static const std::string* bytes = new std::string(kMaxMessage, 'w');
  return bytes->data();
}

tf_rdma::Transport& RegionSource() {
  static tf_rdma::Transport* transport = tf_rdma::CreateShmTransport(tf_rdma::TransportOptions{}).release();
  return *transport;
}

class Harness {
 public:
  Harness(FuzzedDataProvider& in, int peer_fd, bool shm) : in_(in), peer_fd_(peer_fd), shm_(shm) {}

  void Start(std::shared_ptr<tf_rdma::StreamConnection> connection) { connection_ = std::move(connection); }

  void Step() {
    switch (in_.ConsumeIntegralInRange<int>(0, 10)) {
      case 0: case 1: case 2: PeerSends(); break;
      case 3: {
        const uint64_t id = next_write_++;
        writes_[id] = 0;
        const uint64_t length = in_.ConsumeBool() ? in_.ConsumeIntegralInRange<uint64_t>(0, 64)
                                                  : in_.ConsumeIntegralInRange<uint64_t>(0, kMaxMessage);
        connection_->Write(SomeTag(), SourceBytes(), length, [this, id](const absl::Status&) { ++writes_[id]; });
        break;
      }
      case 4: LocalGrant(); break;
      case 5:
        connection_->Revoke(issued_.empty() || in_.ConsumeBool() ? in_.ConsumeIntegral<uint8_t>()
                                                                 : issued_[in_.ConsumeIntegralInRange<size_t>(0, issued_.size() - 1)]);
        break;
      case 6: connection_->DiscardPeerWrites(SomeTag()); break;
      case 7:
        connection_->Withdraw(SomeTag(), in_.ConsumeBool() ? absl::OkStatus() : absl::AbortedError("step aborted"));
        break;
      case 8: connection_->OnTick(absl::Now()); break;
      case 9: connection_->OnEvents(EPOLLOUT); break;
      case 10: connection_->OnEvents(EPOLLIN); break;
    }
    DrainPeerEnd();
  }

  void Finish() {
    connection_->OnLoopStopped();
    connection_->OnRemoved();
    for (const auto& [id, count] : writes_) {
      if (count != 1) Fail("a write did not complete exactly once");
    }
    for (const auto& [id, count] : grants_) {
      if (count != 1) Fail("a grant did not complete exactly once");
    }
  }

 private:
  Tag SomeTag() { return Tag{in_.ConsumeIntegralInRange<uint64_t>(0, 2), 3}; }

  void LocalGrant() {
    const size_t size = in_.ConsumeIntegralInRange<size_t>(0, 1 << 17);
    absl::StatusOr<std::shared_ptr<tf_rdma::MemoryRegion>> region = RegionSource().AllocateRegion(size);
    if (!region.ok()) return;
    const uint64_t offset = in_.ConsumeIntegralInRange<uint64_t>(0, size);
    const uint64_t capacity = in_.ConsumeIntegralInRange<uint64_t>(0, size - offset + (in_.ConsumeBool() ? 1 : 0));
    const uint64_t key = next_grant_++;
    grants_[key] = 0;
    const uint64_t id = connection_->Grant(SomeTag(), *std::move(region), offset, capacity,
                                           [this, key](const tf_rdma::GrantResult&) { ++grants_[key]; });
    if (id != 0) issued_.push_back(id);
  }

  // A region of the peer's, as a memfd: sealed or not, of any size up to 1 MiB.
  int PeerRegion(uint64_t size) {
    const int fd = memfd_create("fuzzed peer region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -1;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      close(fd);
      return -1;
    }
    if (in_.ConsumeBool()) fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    return fd;
  }

  uint64_t SomePeerGrantRange() {
    switch (in_.ConsumeIntegralInRange<int>(0, 3)) {
      case 0: return 0;
      case 1: return 4096;
      case 2: return 1 << 20;
      default: return in_.ConsumeIntegralInRange<uint64_t>(0, (1 << 20) + 1);
    }
  }

  uint64_t SomeReceivedGrant() {
    if (received_grants_.empty() || in_.ConsumeBool()) return in_.ConsumeIntegral<uint8_t>();
    return received_grants_[in_.ConsumeIntegralInRange<size_t>(0, received_grants_.size() - 1)];
  }

  void PeerSends() {
    const auto type = static_cast<FrameType>(in_.ConsumeIntegralInRange<uint8_t>(1, 16));
    std::string bytes;
    int pass_fd = -1;
    std::string payload;
    switch (type) {
      case FrameType::kGrant:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::Grant{in_.ConsumeIntegral<uint8_t>(), SomeTag(),
                                                                 in_.ConsumeIntegralInRange<uint32_t>(0, 3),
                                                                 SomePeerGrantRange(), SomePeerGrantRange()}});
        break;
      case FrameType::kData: {
        const uint64_t length = in_.ConsumeIntegralInRange<uint64_t>(0, 1 << 17);
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::Data{SomeReceivedGrant(), length}});
        if (!shm_) payload.assign(in_.ConsumeIntegralInRange<uint64_t>(0, length), 'p');
        break;
      }
      case FrameType::kTooSmall:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::TooSmall{SomeReceivedGrant(), in_.ConsumeIntegral<uint32_t>()}});
        break;
      case FrameType::kRevoke:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::Revoke{in_.ConsumeIntegral<uint8_t>()}});
        break;
      case FrameType::kRevoked:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::Revoked{SomeReceivedGrant()}});
        break;
      case FrameType::kDiscard:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::Discard{SomeTag()}});
        break;
      case FrameType::kWithdrawn:
        bytes = tf_rdma::wire::Encode(
            {type, tf_rdma::wire::Withdrawn{SomeReceivedGrant(), in_.ConsumeIntegralInRange<uint32_t>(1, 16),
                                            in_.ConsumeRandomLengthString(64)}});
        break;
      case FrameType::kShmRegion: {
        const uint64_t size = SomePeerGrantRange();
        const uint64_t declared = in_.ConsumeBool() ? size : SomePeerGrantRange();
        bytes = tf_rdma::wire::Encode(
            {type, tf_rdma::wire::ShmRegion{in_.ConsumeIntegralInRange<uint32_t>(0, 3), declared}});
        if (in_.ConsumeIntegralInRange<int>(0, 7) != 0) pass_fd = PeerRegion(size);
        break;
      }
      case FrameType::kShmRegionGone:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::ShmRegionGone{in_.ConsumeIntegralInRange<uint32_t>(0, 3)}});
        break;
      case FrameType::kPing:
        bytes = tf_rdma::wire::Encode({type, tf_rdma::wire::Ping{}});
        break;
      default:  // anything, as bytes: a handshake frame, a REJECT, garbage
        bytes = in_.ConsumeRandomLengthString(64);
        break;
    }
    if (type != FrameType::kShmRegion && in_.ConsumeIntegralInRange<int>(0, 15) == 0) pass_fd = PeerRegion(4096);
    bytes += payload;
    tf_rdma::SendWithoutBlocking(peer_fd_, {iovec{bytes.data(), bytes.size()}}, pass_fd).IgnoreError();
    if (pass_fd >= 0) close(pass_fd);
    connection_->OnEvents(EPOLLIN);
  }

  // Every frame sent must decode (SentFrames; descriptors that came along are closed); the
  // connection's grants are kept.
  void DrainPeerEnd() {
    sent_.Drain([this](const tf_rdma::wire::Frame& frame) {
      if (const auto* grant = std::get_if<tf_rdma::wire::Grant>(&frame.body)) received_grants_.push_back(grant->grant_id);
    });
  }

  FuzzedDataProvider& in_;
  const int peer_fd_;
  const bool shm_;
  std::shared_ptr<tf_rdma::StreamConnection> connection_;
  uint64_t next_write_ = 0;
  uint64_t next_grant_ = 0;
  std::map<uint64_t, int> writes_;  // completions per write
  std::map<uint64_t, int> grants_;  // completions per grant
  std::vector<uint64_t> issued_;           // ids of this process's grants
  std::vector<uint64_t> received_grants_;  // ids the connection granted the peer
  tf_rdma::fuzz::SentFrames sent_{peer_fd_, /*payloads_on_socket=*/!shm_};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const bool shm = in.ConsumeBool();
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) Fail("socketpair");
  tf_rdma::TransportOptions options;
  options.local_name = "/job:worker/replica:0/task:0";
  options.limits.max_grants_per_peer = 8;
  options.limits.shm_max_mapped_bytes_per_peer = 3 << 20;
  const tf_rdma::PeerIdentity peer{"/job:ps/replica:0/task:0", "fuzz"};
  Harness harness(in, fds[1], shm);
  harness.Start(shm ? tf_rdma::NewShmConnection(fds[0], peer, "fuzzed peer", options)
                    : tf_rdma::NewTcpConnection(fds[0], peer, "fuzzed peer", options));
  while (in.remaining_bytes() > 0) harness.Step();
  harness.Finish();
  close(fds[1]);
  return 0;
}
