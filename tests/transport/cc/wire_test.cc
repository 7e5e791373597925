// The wire codec, as pure code: what we send decodes to what we meant, and every bound a hostile
// peer could push against (lengths, types, reserved bytes, truncation, trailing bytes, text that
// would forge log lines) is refused with an error, never a crash or a silently wrong frame.
#include "cc/transport/wire.h"

#include <gtest/gtest.h>

#include <string>

namespace tf_rdma::wire {
namespace {

absl::StatusOr<Frame> RoundTrip(const Frame& frame) {
  const std::string bytes = Encode(frame);
  absl::StatusOr<Header> header = DecodeHeader(std::string_view(bytes).substr(0, kHeaderLength));
  if (!header.ok()) return header.status();
  EXPECT_EQ(header->type, frame.type);
  EXPECT_EQ(header->body_length, bytes.size() - kHeaderLength);
  return DecodeBody(header->type, std::string_view(bytes).substr(kHeaderLength));
}

std::string HeaderBytes(uint8_t type, uint32_t length, uint8_t reserved = 0) {
  std::string h = {static_cast<char>(type), static_cast<char>(reserved), 0, 0};
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  return h;
}

TEST(Wire, AGrantRoundTripsEveryField) {
  const Grant grant{0x1122334455667788ULL, Tag{0xdeadbeefULL, 0xfeedfaceULL}, 42, 1ULL << 40, 1ULL << 33};
  absl::StatusOr<Frame> decoded = RoundTrip(Frame{FrameType::kGrant, grant});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const Grant& got = std::get<Grant>(decoded->body);
  EXPECT_EQ(got.grant_id, grant.grant_id);
  EXPECT_TRUE(got.tag == grant.tag);
  EXPECT_EQ(got.region_id, grant.region_id);
  EXPECT_EQ(got.offset, grant.offset);
  EXPECT_EQ(got.capacity, grant.capacity);
}

TEST(Wire, DataTooSmallDiscardAndShmRegionGoneRoundTrip) {
  EXPECT_EQ(std::get<Data>(RoundTrip(Frame{FrameType::kData, Data{7, 99}})->body).length, 99u);
  EXPECT_EQ(std::get<TooSmall>(RoundTrip(Frame{FrameType::kTooSmall, TooSmall{7, 1234}})->body).needed, 1234u);
  EXPECT_TRUE(std::get<Discard>(RoundTrip(Frame{FrameType::kDiscard, Discard{Tag{1, 2}}})->body).tag == (Tag{1, 2}));
  EXPECT_EQ(std::get<ShmRegionGone>(RoundTrip(Frame{FrameType::kShmRegionGone, ShmRegionGone{7}})->body).region_id, 7u);
}

TEST(Wire, AHeaderOfTheWrongLengthIsRefused) {
  EXPECT_EQ(DecodeHeader("1234567").status().code(), absl::StatusCode::kDataLoss);
}

TEST(Wire, UnknownTypesAreRefused) {
  EXPECT_FALSE(DecodeHeader(HeaderBytes(0, 0)).ok());
  EXPECT_FALSE(DecodeHeader(HeaderBytes(0xff, 0)).ok());
  EXPECT_FALSE(DecodeHeader(HeaderBytes(static_cast<uint8_t>(FrameType::kWithdrawn) + 1, 0)).ok());
}

TEST(Wire, ReservedBytesMustBeZero) {
  EXPECT_FALSE(DecodeHeader(HeaderBytes(static_cast<uint8_t>(FrameType::kPing), 0, 1)).ok());
}

TEST(Wire, ABodyLongerThanTheLimitIsRefusedBeforeItIsRead) {
  const uint8_t ping = static_cast<uint8_t>(FrameType::kPing);
  EXPECT_TRUE(DecodeHeader(HeaderBytes(ping, kMaxBodyLength)).ok());
  absl::StatusOr<Header> over = DecodeHeader(HeaderBytes(ping, kMaxBodyLength + 1));
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("exceeds the limit"), absl::string_view::npos);
}

TEST(Wire, TruncatedAndOverlongBodiesAreRefused) {
  const std::string bytes = Encode(Frame{FrameType::kGrant, Grant{1, Tag{1, 1}, 1, 0, 8}});
  const std::string_view body = std::string_view(bytes).substr(kHeaderLength);
  for (size_t cut = 0; cut < body.size(); ++cut) {
    EXPECT_FALSE(DecodeBody(FrameType::kGrant, body.substr(0, cut)).ok()) << "cut at " << cut;
  }
  EXPECT_FALSE(DecodeBody(FrameType::kGrant, std::string(body) + "x").ok());
}

TEST(Wire, APeersTextCannotForgeLogLinesNorBreakUtf8) {
  absl::StatusOr<Frame> decoded =
      RoundTrip(Frame{FrameType::kReject, Reject{3, "bad\nI0000 forged line \xff"}});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(std::get<Reject>(decoded->body).message, "bad\\x0aI0000 forged line \\xff");
}

TEST(Wire, AWithdrawnRoundTripsWithItsReasonEscapedAndCut) {
  absl::StatusOr<Frame> decoded = RoundTrip(
      Frame{FrameType::kWithdrawn, Withdrawn{77, 10, "step aborted\nI0000 forged " + std::string(1000, 'x')}});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const Withdrawn& got = std::get<Withdrawn>(decoded->body);
  EXPECT_EQ(got.grant_id, 77u);
  EXPECT_EQ(got.code, 10u);
  // Cut to the bound when sent, then escaped: "\n" takes four characters.
  EXPECT_EQ(got.reason.substr(0, 30), "step aborted\\x0aI0000 forged x");
  EXPECT_EQ(got.reason.size(), kMaxWithdrawnReasonLength + 3);
}

std::string WithdrawnBody(uint32_t code, size_t reason_length) {
  std::string body(8, '\1');  // grant id
  for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>((code >> (8 * i)) & 0xff));
  body.push_back(static_cast<char>(reason_length & 0xff));
  body.push_back(static_cast<char>(reason_length >> 8));
  return body + std::string(reason_length, 'r');
}

TEST(Wire, AWithdrawnWithAnOverlongReasonOrANonErrorCodeIsRefused) {
  EXPECT_TRUE(DecodeBody(FrameType::kWithdrawn, WithdrawnBody(10, kMaxWithdrawnReasonLength)).ok());
  absl::StatusOr<Frame> long_reason = DecodeBody(FrameType::kWithdrawn, WithdrawnBody(10, kMaxWithdrawnReasonLength + 1));
  ASSERT_FALSE(long_reason.ok());
  EXPECT_NE(long_reason.status().message().find("exceeds the limit of 256"), absl::string_view::npos);
  for (uint32_t code : {0u, 17u, 0xffffffffu}) {
    absl::StatusOr<Frame> bad = DecodeBody(FrameType::kWithdrawn, WithdrawnBody(code, 3));
    ASSERT_FALSE(bad.ok()) << code;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(bad.status().message().find("is not an error code"), absl::string_view::npos);
  }
  EXPECT_TRUE(DecodeBody(FrameType::kWithdrawn, WithdrawnBody(16, 0)).ok());
}

}  // namespace
}  // namespace tf_rdma::wire
