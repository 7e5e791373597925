// The frame decoder (cc/transport/wire.h) fed a peer's bytes: a stream of frames, decoded as a
// connection decodes them. Whatever it accepts, encoding it again must give a frame the decoder
// accepts and that encodes to the same bytes: a decoded frame is one this process could have sent.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "cc/transport/wire.h"

namespace {

using tf_rdma::wire::Frame;

[[noreturn]] void Fail(const char* why) {
  __builtin_printf("wire_fuzz: %s\n", why);
  std::abort();
}

Frame MustDecode(const std::string& encoded) {
  absl::StatusOr<tf_rdma::wire::Header> header =
      tf_rdma::wire::DecodeHeader(std::string_view(encoded).substr(0, tf_rdma::wire::kHeaderLength));
  if (!header.ok()) Fail("an encoded frame's header does not decode");
  if (header->body_length != encoded.size() - tf_rdma::wire::kHeaderLength) Fail("header length is not the body's");
  absl::StatusOr<Frame> frame =
      tf_rdma::wire::DecodeBody(header->type, std::string_view(encoded).substr(tf_rdma::wire::kHeaderLength));
  if (!frame.ok()) Fail("an encoded frame's body does not decode");
  return *std::move(frame);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  while (in.size() >= tf_rdma::wire::kHeaderLength) {
    absl::StatusOr<tf_rdma::wire::Header> header = tf_rdma::wire::DecodeHeader(in.substr(0, tf_rdma::wire::kHeaderLength));
    if (!header.ok()) return 0;
    in.remove_prefix(tf_rdma::wire::kHeaderLength);
    if (header->body_length > in.size()) return 0;
    absl::StatusOr<Frame> frame = tf_rdma::wire::DecodeBody(header->type, in.substr(0, header->body_length));
    in.remove_prefix(header->body_length);
    if (!frame.ok()) continue;  // a connection ends here; the rest still exercises the decoder
    if (frame->type != header->type) Fail("decoded frame changed its type");
    const std::string encoded = tf_rdma::wire::Encode(*frame);
    if (encoded.size() > tf_rdma::wire::kHeaderLength + tf_rdma::wire::kMaxBodyLength) {
      Fail("re-encoded frame exceeds the body limit");
    }
    if (tf_rdma::wire::Encode(MustDecode(encoded)) != encoded) Fail("decode(encode(frame)) is not the frame");
  }
  return 0;
}
