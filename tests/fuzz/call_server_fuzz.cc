// The serving side of control calls (cc/tf/calls/call_channel.h: CallServer) on a tcp connection
// driven event by event on the fuzzer's thread, over a socketpair whose other end is a peer that
// fills the request slots and the body grants it is given with fuzzed call messages (well formed or
// not, of every size up to past the limits, cancellations, repeated call ids), grants reply memory
// or not, takes grants back, withdraws bodies, and sends raw frames; served calls are answered at
// once, held and answered later, or never. Checked: no memory error (ASan, UBSan), a served call's
// cancellation runs at most once, the calls held at once stay within TF_RDMA_MAX_CALLS_PER_PEER,
// the request bodies held stay within TF_RDMA_MAX_CALL_BYTES, and every frame sent decodes.
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cc/tf/calls/call_channel.h"
#include "cc/tf/messages/call_message.h"
#include "cc/transport/handshake.h"
#include "cc/transport/shm/shm_transport.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/stream/stream_connection.h"
#include "cc/transport/tcp/tcp_transport.h"
#include "cc/transport/wire.h"
#include "tests/fuzz/sent_frames.h"

namespace {

using tf_rdma::Tag;
using tf_rdma::wire::FrameType;

[[noreturn]] void Fail(const char* why) {
  __builtin_printf("call_server_fuzz: %s\n", why);
  std::abort();
}

constexpr tf_rdma::CallLimits kLimits{64 << 10, 3};

tf_rdma::Transport& RegionSource() {
  static tf_rdma::Transport* transport = tf_rdma::CreateShmTransport(tf_rdma::TransportOptions{}).release();
  return *transport;
}

class Harness {
 public:
  Harness(FuzzedDataProvider& in, int peer_fd) : in_(in), peer_fd_(peer_fd) {}

  void Start(std::shared_ptr<tf_rdma::StreamConnection> connection) {
    connection_ = std::move(connection);
    pool_ = std::make_shared<tf_rdma::BufferPool>(&RegionSource(), 64 << 10, 1 << 20);
    const absl::Status started = tf_rdma::CallServer::Start(
        connection_, RegionSource(), pool_, kLimits,
        [this](std::shared_ptr<tf_rdma::ServedCall> call) { Serve(std::move(call)); });
    if (!started.ok()) Fail("the call server did not start");
    DrainPeerEnd();
  }

  void Step() {
    switch (in_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: case 1: case 2: PeerWritesRequest(); break;
      case 3: PeerWritesBody(); break;
      case 4: PeerGrantsReply(); break;
      case 5: AnswerHeld(); break;
      case 6: PeerSendsOther(); break;
      case 7: connection_->OnTick(absl::Now()); break;
      case 8: connection_->OnEvents(EPOLLOUT); break;
      case 9: connection_->OnEvents(EPOLLIN); break;
    }
    DrainPeerEnd();
    CheckBounds();
  }

  void Finish() {
    connection_->OnLoopStopped();
    connection_->OnRemoved();
    while (!held_.empty()) AnswerHeld();
    for (int count : cancels_) {
      if (count > 1) Fail("a served call's cancellation ran more than once");
    }
  }

 private:
  struct Held {
    std::shared_ptr<tf_rdma::ServedCall> call;
  };

  void Serve(std::shared_ptr<tf_rdma::ServedCall> call) {
    const size_t index = cancels_.size();
    cancels_.push_back(0);
    switch (call->method() % 3) {
      case 0:
        call->Reply(absl::OkStatus(), call->request());
        return;
      case 1:
        call->Reply(absl::InvalidArgumentError("fuzzed"), {});
        return;
      default:
        call->SetCancelCallback([this, index] { ++cancels_[index]; });
        held_.push_back(Held{std::move(call)});
    }
  }

  void AnswerHeld() {
    if (held_.empty()) return;
    const size_t at = in_.ConsumeIntegralInRange<size_t>(0, held_.size() - 1);
    held_[at].call->Reply(absl::OkStatus(), std::string(in_.ConsumeIntegralInRange<size_t>(0, 9000), 'r'));
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(at));
  }

  void CheckBounds() {
    if (held_.size() > kLimits.max_calls_in_flight) Fail("more calls held than TF_RDMA_MAX_CALLS_PER_PEER admits");
    // Each body buffer is rounded up to the pool's alignment.
    if (pool_->usage().bytes_in_use > kLimits.max_payload_bytes + kLimits.max_calls_in_flight * 64) {
      Fail("request bodies hold more than TF_RDMA_MAX_CALL_BYTES");
    }
  }

  uint64_t SomePayloadBytes() {
    switch (in_.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: return 0;
      case 1: return in_.ConsumeIntegralInRange<uint64_t>(1, 64);
      case 2: return tf_rdma::kCallRequestSlotBytes - tf_rdma::kCallRequestHeaderBytes;
      case 3: return tf_rdma::kCallRequestSlotBytes - tf_rdma::kCallRequestHeaderBytes + 1;
      case 4: return in_.ConsumeIntegralInRange<uint64_t>(0, kLimits.max_payload_bytes + 1);
      default: return in_.ConsumeIntegral<uint64_t>();
    }
  }

  // A DATA frame into one of the grants the connection gave the peer, carrying `message`.
  void SendData(uint64_t grant_id, const std::string& message) {
    std::string bytes = tf_rdma::wire::Encode({FrameType::kData, tf_rdma::wire::Data{grant_id, message.size()}});
    bytes += message;
    tf_rdma::SendWithoutBlocking(peer_fd_, {iovec{bytes.data(), bytes.size()}}, -1).IgnoreError();
    connection_->OnEvents(EPOLLIN);
  }

  uint64_t SomeGrant(const std::vector<tf_rdma::wire::Grant>& grants) {
    if (grants.empty() || in_.ConsumeIntegralInRange<int>(0, 7) == 0) return in_.ConsumeIntegral<uint8_t>();
    return grants[in_.ConsumeIntegralInRange<size_t>(0, grants.size() - 1)].grant_id;
  }

  void PeerWritesRequest() {
    std::string message;
    if (in_.ConsumeIntegralInRange<int>(0, 7) == 0) {
      message = in_.ConsumeRandomLengthString(64);
    } else {
      tf_rdma::CallRequestHeader header;
      header.frame = in_.ConsumeIntegralInRange<int>(0, 5) == 0 ? tf_rdma::CallFrame::kCancel
                                                                : tf_rdma::CallFrame::kRequest;
      header.method = in_.ConsumeIntegral<uint8_t>();
      header.call_id = in_.ConsumeIntegralInRange<uint64_t>(0, 7);
      header.payload_bytes = header.frame == tf_rdma::CallFrame::kCancel ? 0 : SomePayloadBytes();
      const bool travels_inline = tf_rdma::CallPayloadTravelsInline(header.payload_bytes);
      message = tf_rdma::EncodeCallRequest(header, travels_inline ? std::string(header.payload_bytes, 'q') : "");
      if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) message.resize(in_.ConsumeIntegralInRange<size_t>(0, 9000), 'x');
    }
    SendData(SomeGrant(slot_grants_), message);
  }

  void PeerWritesBody() {
    const uint64_t grant = SomeGrant(body_grants_);
    SendData(grant, std::string(in_.ConsumeIntegralInRange<size_t>(0, kLimits.max_payload_bytes + 1), 'b'));
  }

  void PeerGrantsReply() {
    // Grants to a peer name memory this process never reads or writes on tcp: only the range.
    const Tag tag = tf_rdma::CallReplyTag(in_.ConsumeIntegralInRange<uint64_t>(0, 7));
    const std::string bytes = tf_rdma::wire::Encode(
        {FrameType::kGrant, tf_rdma::wire::Grant{next_peer_grant_++, tag, 0, 0,
                                                 in_.ConsumeIntegralInRange<uint64_t>(0, 1 << 14)}});
    tf_rdma::SendWithoutBlocking(peer_fd_, {iovec{const_cast<char*>(bytes.data()), bytes.size()}}, -1).IgnoreError();
    connection_->OnEvents(EPOLLIN);
  }

  void PeerSendsOther() {
    std::string bytes;
    switch (in_.ConsumeIntegralInRange<int>(0, 4)) {
      case 0:
        bytes = tf_rdma::wire::Encode({FrameType::kRevoke, tf_rdma::wire::Revoke{in_.ConsumeIntegral<uint8_t>()}});
        break;
      case 1:
        bytes = tf_rdma::wire::Encode(
            {FrameType::kWithdrawn, tf_rdma::wire::Withdrawn{SomeGrant(body_grants_), 1, "withdrawn"}});
        break;
      case 2:
        bytes = tf_rdma::wire::Encode({FrameType::kTooSmall, tf_rdma::wire::TooSmall{
                                                                 SomeGrant(slot_grants_), in_.ConsumeIntegral<uint32_t>()}});
        break;
      case 3:
        bytes = tf_rdma::wire::Encode({FrameType::kDiscard, tf_rdma::wire::Discard{tf_rdma::CallReplyTag(
                                                                in_.ConsumeIntegralInRange<uint64_t>(0, 7))}});
        break;
      default:
        bytes = in_.ConsumeRandomLengthString(32);
    }
    tf_rdma::SendWithoutBlocking(peer_fd_, {iovec{bytes.data(), bytes.size()}}, -1).IgnoreError();
    connection_->OnEvents(EPOLLIN);
  }

  // Every frame sent must decode (SentFrames); grants are kept by their tag.
  void DrainPeerEnd() {
    sent_.Drain([this](const tf_rdma::wire::Frame& frame) {
      if (const auto* grant = std::get_if<tf_rdma::wire::Grant>(&frame.body)) {
        (grant->tag == tf_rdma::CallRequestTag() ? slot_grants_ : body_grants_).push_back(*grant);
      }
    });
  }

  FuzzedDataProvider& in_;
  const int peer_fd_;
  std::shared_ptr<tf_rdma::StreamConnection> connection_;
  std::shared_ptr<tf_rdma::BufferPool> pool_;
  std::vector<Held> held_;
  std::vector<int> cancels_;  // per served call, how often its cancellation ran
  std::vector<tf_rdma::wire::Grant> slot_grants_;
  std::vector<tf_rdma::wire::Grant> body_grants_;
  uint64_t next_peer_grant_ = 1;
  tf_rdma::fuzz::SentFrames sent_{peer_fd_, /*payloads_on_socket=*/true};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) Fail("socketpair");
  tf_rdma::TransportOptions options;
  options.local_name = "/job:ps/replica:0/task:0";
  options.limits.max_grants_per_peer = 16;
  const tf_rdma::PeerIdentity peer{"/job:worker/replica:0/task:0", "fuzz"};
  {
    Harness harness(in, fds[1]);
    harness.Start(tf_rdma::NewTcpConnection(fds[0], peer, "fuzzed peer", options));
    while (in.remaining_bytes() > 0) harness.Step();
    harness.Finish();
  }
  close(fds[1]);
  return 0;
}
