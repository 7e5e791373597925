// A stream connection's sends as its peer sees them: frames that the connection's own I/O thread
// queues while it handles the connection's events (a callback that grants again and replies, as an
// event-driven user does) leave in one send, so the peer wakes once for them. The peer's end is a
// SOCK_SEQPACKET socket, where each receive returns exactly one send's bytes.
#include "cc/transport/stream/stream_connection.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "cc/transport/io_loops.h"
#include "cc/transport/wire.h"

namespace tf_rdma {
namespace {

// The tcp backend's payload path: the message follows its DATA frame on the stream.
class PayloadOnStreamConnection : public StreamConnection {
 public:
  using StreamConnection::StreamConnection;

 protected:
  absl::StatusOr<bool> PlaceMessage(const wire::Grant&, const void*, uint64_t) override { return true; }
  bool PayloadOnStream() const override { return true; }
};

class BufferRegion : public MemoryRegion {
 public:
  BufferRegion(char* data, size_t size) : MemoryRegion(1, data, size) {}
};

// One send of the connection's: its bytes, or empty when none came within 5 s.
std::string ReceiveOneSend(int fd) {
  pollfd ready{fd, POLLIN, 0};
  if (poll(&ready, 1, 5000) != 1) return "";
  std::string bytes(1 << 16, '\0');
  const ssize_t n = recv(fd, bytes.data(), bytes.size(), 0);
  bytes.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return bytes;
}

// The frames in `bytes`, skipping a DATA frame's payload of `payload_length` bytes.
std::vector<wire::Frame> Frames(std::string_view bytes, uint64_t payload_length) {
  std::vector<wire::Frame> frames;
  while (bytes.size() >= wire::kHeaderLength) {
    absl::StatusOr<wire::Header> header = wire::DecodeHeader(bytes.substr(0, wire::kHeaderLength));
    if (!header.ok() || bytes.size() < wire::kHeaderLength + header->body_length) break;
    absl::StatusOr<wire::Frame> frame =
        wire::DecodeBody(header->type, bytes.substr(wire::kHeaderLength, header->body_length));
    if (!frame.ok()) break;
    bytes.remove_prefix(wire::kHeaderLength + header->body_length);
    if (frame->type == wire::FrameType::kData) bytes.remove_prefix(std::min(bytes.size(), payload_length));
    frames.push_back(*std::move(frame));
  }
  return frames;
}

void Send(int fd, const std::string& bytes) {
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

TEST(StreamConnectionTest, FramesQueuedByACallbackOnTheConnectionsThreadLeaveInOneSend) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds), 0);
  const int peer = fds[1];
  IoLoops loops(1, absl::Milliseconds(100));
  ASSERT_TRUE(loops.Start().ok());
  absl::StatusOr<std::shared_ptr<IoLoop>> loop = loops.Next();
  ASSERT_TRUE(loop.ok());
  auto connection = std::make_shared<PayloadOnStreamConnection>(
      fds[0], Backend::kTcp, PeerIdentity{"peer", "test"}, "socketpair", TransportOptions{});
  ASSERT_TRUE(connection->Start(*loop).ok());

  // The peer grants the reply's destination first.
  constexpr uint64_t kReplyGrant = 77;
  Send(peer, wire::Encode({wire::FrameType::kGrant, wire::Grant{kReplyGrant, Tag{5, 0}, 9, 0, 64}}));

  char landing[16] = {};
  auto region = std::make_shared<BufferRegion>(landing, sizeof(landing));
  const char reply[8] = {'r', 'e', 'p', 'l', 'y', '!', '!', '!'};
  std::promise<void> replied;
  // A grant from this thread goes out at once, in a send of its own.
  connection->Grant(Tag{3, 0}, region, 0, 8, [&](const GrantResult& landed) {
    EXPECT_TRUE(landed.status.ok()) << landed.status;
    connection->Grant(Tag{4, 0}, region, 8, 8, [](const GrantResult&) {});
    connection->Write(Tag{5, 0}, reply, sizeof(reply), [&](const absl::Status& status) {
      EXPECT_TRUE(status.ok()) << status;
      replied.set_value();
    });
  });
  const std::vector<wire::Frame> first = Frames(ReceiveOneSend(peer), 0);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(first[0].type, wire::FrameType::kGrant);
  const uint64_t ping_grant = std::get<wire::Grant>(first[0].body).grant_id;

  Send(peer, wire::Encode({wire::FrameType::kData, wire::Data{ping_grant, 8}}) + "ping!!!!");
  const std::string answer = ReceiveOneSend(peer);
  const std::vector<wire::Frame> frames = Frames(answer, sizeof(reply));
  ASSERT_EQ(frames.size(), 2u) << "the callback's grant and reply took more than one send";
  EXPECT_EQ(frames[0].type, wire::FrameType::kGrant);
  EXPECT_EQ(std::get<wire::Grant>(frames[0].body).tag, (Tag{4, 0}));
  ASSERT_EQ(frames[1].type, wire::FrameType::kData);
  EXPECT_EQ(std::get<wire::Data>(frames[1].body).grant_id, kReplyGrant);
  EXPECT_EQ(answer.substr(answer.size() - sizeof(reply)), std::string(reply, sizeof(reply)));
  EXPECT_EQ(std::string(landing, 8), "ping!!!!");
  EXPECT_EQ(replied.get_future().wait_for(std::chrono::seconds(5)), std::future_status::ready);

  connection->Close(absl::CancelledError("test done"));
  close(peer);
}

}  // namespace
}  // namespace tf_rdma
