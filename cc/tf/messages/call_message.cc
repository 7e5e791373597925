#include "cc/tf/messages/call_message.h"

#include "absl/strings/str_cat.h"
#include "cc/tf/messages/tensor_message.h"

namespace tf_rdma {
namespace {

constexpr uint32_t kRequestMagic = 0x43524654;  // "TFRC"
constexpr uint32_t kReplyMagic = 0x52524654;    // "TFRR"
constexpr uint64_t kReplyHeaderBytes = 24;
// The high halves of the call tags. Tensor tags are digests (tensor_message.h), so a fixed value
// meets one with a chance of 2^-64.
constexpr uint64_t kRequestTagHi = 0x74665f7264636c72;  // "rlcdr_ft"
constexpr uint64_t kBodyTagHi = 0x74665f7264636c62;
constexpr uint64_t kReplyTagHi = 0x74665f7264636c79;

uint32_t Load32(const char* bytes) {
  return static_cast<uint32_t>(LoadLittleEndian64(reinterpret_cast<const uint8_t*>(bytes)) & 0xffffffffu);
}

}  // namespace

Tag CallRequestTag() { return Tag{kRequestTagHi, 0}; }
Tag CallBodyTag(uint64_t call_id) { return Tag{kBodyTagHi, call_id}; }
Tag CallReplyTag(uint64_t call_id) { return Tag{kReplyTagHi, call_id}; }

bool CallPayloadTravelsInline(uint64_t bytes) { return bytes <= kCallRequestSlotBytes - kCallRequestHeaderBytes; }

std::string EncodeCallRequest(const CallRequestHeader& header, std::string_view inline_payload) {
  std::string out;
  out.reserve(kCallRequestHeaderBytes + inline_payload.size());
  AppendLittleEndian(out, kRequestMagic, 4);
  AppendLittleEndian(out, static_cast<uint8_t>(header.frame), 1);
  AppendLittleEndian(out, header.method, 1);
  AppendLittleEndian(out, 0, 2);
  AppendLittleEndian(out, header.call_id, 8);
  AppendLittleEndian(out, header.payload_bytes, 8);
  out.append(inline_payload);
  return out;
}

absl::StatusOr<CallRequestHeader> DecodeCallRequest(const char* message, uint64_t length, uint64_t max_payload_bytes,
                                                    std::string_view* inline_payload) {
  // 8 bytes are read at a time (LoadLittleEndian64): the header's last field ends at its end.
  if (length < kCallRequestHeaderBytes) {
    return absl::DataLossError(absl::StrCat("a call request of ", length, " bytes, shorter than its ",
                                            kCallRequestHeaderBytes, "-byte header"));
  }
  if (Load32(message) != kRequestMagic) return absl::DataLossError("a call request without its magic number");
  CallRequestHeader header;
  const uint8_t frame = static_cast<uint8_t>(message[4]);
  if (frame != static_cast<uint8_t>(CallFrame::kRequest) && frame != static_cast<uint8_t>(CallFrame::kCancel)) {
    return absl::DataLossError(absl::StrCat("a call message of unknown kind ", frame));
  }
  header.frame = static_cast<CallFrame>(frame);
  header.method = static_cast<uint8_t>(message[5]);
  header.call_id = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(message + 8));
  header.payload_bytes = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(message + 16));
  if (header.frame == CallFrame::kCancel && (header.payload_bytes != 0 || length != kCallRequestHeaderBytes)) {
    return absl::DataLossError(absl::StrCat("call ", header.call_id, "'s cancellation carries a payload"));
  }
  if (header.payload_bytes > max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("call ", header.call_id, " announces a request of ",
                                                     header.payload_bytes, " bytes, more than the ",
                                                     max_payload_bytes, " TF_RDMA_MAX_CALL_BYTES allows"));
  }
  const bool inline_payload_expected = CallPayloadTravelsInline(header.payload_bytes);
  const uint64_t expected = kCallRequestHeaderBytes + (inline_payload_expected ? header.payload_bytes : 0);
  if (length != expected) {
    return absl::DataLossError(absl::StrCat("call ", header.call_id, "'s request message is ", length,
                                            " bytes; its header says ", expected));
  }
  *inline_payload = inline_payload_expected ? std::string_view(message + kCallRequestHeaderBytes, header.payload_bytes)
                                            : std::string_view();
  return header;
}

std::string EncodeCallReply(const absl::Status& status, std::string_view payload) {
  std::string out;
  const std::string_view text = status.message();
  out.reserve(kReplyHeaderBytes + text.size() + payload.size());
  AppendLittleEndian(out, kReplyMagic, 4);
  AppendLittleEndian(out, static_cast<uint32_t>(status.code()), 4);
  AppendLittleEndian(out, text.size(), 4);
  AppendLittleEndian(out, 0, 4);
  AppendLittleEndian(out, payload.size(), 8);
  out.append(text);
  out.append(payload);
  return out;
}

absl::StatusOr<CallReply> DecodeCallReply(const char* message, uint64_t length) {
  if (length < kReplyHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("a call reply of ", length, " bytes, shorter than its ", kReplyHeaderBytes, "-byte header"));
  }
  if (Load32(message) != kReplyMagic) return absl::DataLossError("a call reply without its magic number");
  const uint32_t code = Load32(message + 4);
  const uint64_t text_bytes = Load32(message + 8);
  const uint64_t payload_bytes = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(message + 16));
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::DataLossError(absl::StrCat("a call reply with status code ", code, ", not a status code"));
  }
  // Compared as a sum of numbers each below 2^33 and the length: no overflow.
  if (payload_bytes > length || kReplyHeaderBytes + text_bytes + payload_bytes != length) {
    return absl::DataLossError(absl::StrCat("a call reply of ", length, " bytes whose header says ",
                                            kReplyHeaderBytes, " + ", text_bytes, " + ", payload_bytes));
  }
  CallReply reply;
  const auto status_code = static_cast<absl::StatusCode>(code);
  const std::string_view text(message + kReplyHeaderBytes, text_bytes);
  reply.status = status_code == absl::StatusCode::kOk ? absl::OkStatus() : absl::Status(status_code, text);
  reply.payload = std::string_view(message + kReplyHeaderBytes + text_bytes, payload_bytes);
  return reply;
}

}  // namespace tf_rdma
