// The frames a connection under fuzzing sent to the fuzzer's end of its socketpair, read without
// blocking, for the targets that drive a StreamConnection as its peer: every frame must decode,
// else the run aborts. A data frame's payload follows it on the socket (tcp), or lies in a shared
// region (shm: `payloads_on_socket` false).
#ifndef TF_RDMA_TESTS_FUZZ_SENT_FRAMES_H_
#define TF_RDMA_TESTS_FUZZ_SENT_FRAMES_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <variant>

#include "cc/transport/stream/socket_io.h"
#include "cc/transport/wire.h"

namespace tf_rdma::fuzz {

class SentFrames {
 public:
  SentFrames(int fd, bool payloads_on_socket) : fd_(fd), payloads_on_socket_(payloads_on_socket) {}

  // Reads what is there; `on_frame(const wire::Frame&)` runs for each whole frame, in order.
  template <typename OnFrame>
  void Drain(OnFrame on_frame) {
    char buffer[1 << 16];
    for (;;) {
      absl::StatusOr<size_t> got = ReceiveSome(fd_, buffer, sizeof(buffer), nullptr, /*nonblocking=*/true);
      if (!got.ok() || *got == 0) return;
      unread_.append(buffer, *got);
      Parse(on_frame);
    }
  }

 private:
  [[noreturn]] static void Fail(const char* why) {
    __builtin_printf("sent frames: %s\n", why);
    std::abort();
  }

  template <typename OnFrame>
  void Parse(OnFrame& on_frame) {
    for (;;) {
      if (payload_left_ > 0) {
        const uint64_t skipped = std::min<uint64_t>(payload_left_, unread_.size());
        unread_.erase(0, skipped);
        payload_left_ -= skipped;
        if (payload_left_ > 0) return;
      }
      if (unread_.size() < wire::kHeaderLength) return;
      absl::StatusOr<wire::Header> header = wire::DecodeHeader(std::string_view(unread_).substr(0, wire::kHeaderLength));
      if (!header.ok()) Fail("the connection sent a malformed frame header");
      if (unread_.size() < wire::kHeaderLength + header->body_length) return;
      absl::StatusOr<wire::Frame> frame =
          wire::DecodeBody(header->type, std::string_view(unread_).substr(wire::kHeaderLength, header->body_length));
      if (!frame.ok()) Fail("the connection sent a frame that does not decode");
      unread_.erase(0, wire::kHeaderLength + header->body_length);
      if (const auto* data = std::get_if<wire::Data>(&frame->body); data != nullptr && payloads_on_socket_) {
        payload_left_ = data->length;
      }
      on_frame(*frame);
    }
  }

  const int fd_;
  const bool payloads_on_socket_;
  std::string unread_;
  uint64_t payload_left_ = 0;
};

}  // namespace tf_rdma::fuzz

#endif  // TF_RDMA_TESTS_FUZZ_SENT_FRAMES_H_
