#include "cc/tf/messages/call_message.h"

#include "absl/strings/str_cat.h"
#include "cc/tf/messages/tensor_message.h"

namespace tf_rdma {
namespace {

constexpr uint32_t kCallRequestMagic = 0x43524654;  // "TFRC"
constexpr uint32_t kCallReplyMagic = 0x52524654;    // "TFRR"
constexpr uint64_t kCallReplyHeaderBytes = 24;
// The high halves of the call tags. Tensor tags are digests (tensor_message.h), so a fixed value
// meets one with a chance of 2^-64.
constexpr uint64_t kCallRequestTagHi = 0x74665f7264636c72;  // "rlcdr_ft"
constexpr uint64_t kCallBodyTagHi = 0x74665f7264636c62;
constexpr uint64_t kCallReplyTagHi = 0x74665f7264636c79;

uint32_t LoadCallField32(const char* bytes) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  return v;
}

}  // namespace

Tag CallRequestTag() { return Tag{kCallRequestTagHi, 0}; }
Tag CallBodyTag(uint64_t call_id) { return Tag{kCallBodyTagHi, call_id}; }
Tag CallReplyTag(uint64_t call_id) { return Tag{kCallReplyTagHi, call_id}; }

bool CallPayloadTravelsInline(uint64_t bytes) { return bytes <= kCallRequestSlotBytes - kCallRequestHeaderBytes; }

std::string EncodeCallRequest(const CallRequestHeader& header, std::string_view inline_payload) {
  std::string out;
  out.reserve(kCallRequestHeaderBytes + inline_payload.size());
  AppendLittleEndian(out, kCallRequestMagic, 4);
  AppendLittleEndian(out, static_cast<uint8_t>(header.frame), 1);
  AppendLittleEndian(out, header.method, 1);
  AppendLittleEndian(out, 0, 2);
  AppendLittleEndian(out, header.call_id, 8);
  AppendLittleEndian(out, header.payload_bytes, 8);
  out.append(inline_payload);
  return out;
}

absl::StatusOr<CallRequestHeader> DecodeCallRequest(const char* message, uint64_t length,
                                                    std::string_view* inline_payload) {
  // 8 bytes are read at a time (LoadLittleEndian64): the header's last field ends at its end.
  if (length < kCallRequestHeaderBytes) {
    return absl::DataLossError(absl::StrCat("a call request of ", length, " bytes, shorter than its ",
                                            kCallRequestHeaderBytes, "-byte header"));
  }
  if (LoadCallField32(message) != kCallRequestMagic) return absl::DataLossError("a call request without its magic number");
  CallRequestHeader header;
  const uint8_t frame = static_cast<uint8_t>(message[4]);
  if (frame != static_cast<uint8_t>(CallFrame::kRequest) && frame != static_cast<uint8_t>(CallFrame::kCancel)) {
    return absl::DataLossError(absl::StrCat("a call message of unknown kind ", frame));
  }
  header.frame = static_cast<CallFrame>(frame);
  header.method = static_cast<uint8_t>(message[5]);
  if (message[6] != 0 || message[7] != 0) return absl::DataLossError("a call request with its reserved bytes set");
  header.call_id = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(message + 8));
  header.payload_bytes = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(message + 16));
  if (header.frame == CallFrame::kCancel && (header.payload_bytes != 0 || length != kCallRequestHeaderBytes)) {
    return absl::DataLossError(absl::StrCat("call ", header.call_id, "'s cancellation carries a payload"));
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
  // The status's payloads travel too: TensorFlow marks errors with them (a derived error, one a
  // worker reports for another), and decides by them which error a step reports.
  std::string extras;
  status.ForEachPayload([&extras](std::string_view type_url, const absl::Cord& value) {
    AppendLittleEndian(extras, type_url.size(), 4);
    AppendLittleEndian(extras, value.size(), 4);
    extras.append(type_url);
    extras.append(std::string(value));
  });
  std::string out;
  const std::string_view text = status.message();
  out.reserve(kCallReplyHeaderBytes + text.size() + extras.size() + payload.size());
  AppendLittleEndian(out, kCallReplyMagic, 4);
  AppendLittleEndian(out, static_cast<uint32_t>(status.code()), 4);
  AppendLittleEndian(out, text.size(), 4);
  AppendLittleEndian(out, extras.size(), 4);
  AppendLittleEndian(out, payload.size(), 8);
  out.append(text);
  out.append(extras);
  out.append(payload);
  return out;
}

absl::StatusOr<CallReply> DecodeCallReply(const char* message, uint64_t length) {
  if (length < kCallReplyHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("a call reply of ", length, " bytes, shorter than its ", kCallReplyHeaderBytes, "-byte header"));
  }
  if (LoadCallField32(message) != kCallReplyMagic) return absl::DataLossError("a call reply without its magic number");
  const uint32_t code = LoadCallField32(message + 4);
  const uint64_t text_bytes = LoadCallField32(message + 8);
  const uint64_t extras_bytes = LoadCallField32(message + 12);
  const uint64_t payload_bytes = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(message + 16));
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::DataLossError(absl::StrCat("a call reply with status code ", code, ", not a status code"));
  }
  // Compared as a sum of numbers each below 2^33 and the length: no overflow.
  if (payload_bytes > length || kCallReplyHeaderBytes + text_bytes + extras_bytes + payload_bytes != length) {
    return absl::DataLossError(absl::StrCat("a call reply of ", length, " bytes whose header says ",
                                            kCallReplyHeaderBytes, " + ", text_bytes, " + ", extras_bytes, " + ",
                                            payload_bytes));
  }
  const auto status_code = static_cast<absl::StatusCode>(code);
  const char* text = message + kCallReplyHeaderBytes;
  const char* extras = text + text_bytes;
  if (status_code == absl::StatusCode::kOk && (text_bytes != 0 || extras_bytes != 0)) {
    return absl::DataLossError("an OK call reply with an error's message");
  }
  CallReply reply;
  reply.status = status_code == absl::StatusCode::kOk ? absl::OkStatus()
                                                      : absl::Status(status_code, std::string_view(text, text_bytes));
  for (uint64_t at = 0; at < extras_bytes;) {
    if (extras_bytes - at < 8) return absl::DataLossError("a call reply's status payload cut short");
    const uint64_t url_bytes = LoadCallField32(extras + at);
    const uint64_t value_bytes = LoadCallField32(extras + at + 4);
    at += 8;
    if (url_bytes > extras_bytes - at || value_bytes > extras_bytes - at - url_bytes) {
      return absl::DataLossError("a call reply's status payload runs past the reply");
    }
    reply.status.SetPayload(std::string_view(extras + at, url_bytes),
                            absl::Cord(std::string_view(extras + at + url_bytes, value_bytes)));
    at += url_bytes + value_bytes;
  }
  reply.payload = std::string_view(extras + extras_bytes, payload_bytes);
  return reply;
}

std::string EncodeCleanupSteps(absl::Span<const int64_t> step_ids) {
  std::string bytes;
  bytes.reserve(step_ids.size() * 8);
  for (int64_t id : step_ids) AppendLittleEndian(bytes, static_cast<uint64_t>(id), 8);
  return bytes;
}

absl::StatusOr<std::vector<int64_t>> DecodeCleanupSteps(std::string_view bytes) {
  if (bytes.empty() || bytes.size() % 8 != 0 || bytes.size() / 8 > kMaxCleanupSteps) {
    return absl::InvalidArgumentError(absl::StrCat("tf_rdma: a CleanupGraphs request of ", bytes.size(),
                                                   " bytes (1 to ", kMaxCleanupSteps, " step ids of 8 bytes)"));
  }
  std::vector<int64_t> step_ids(bytes.size() / 8);
  for (size_t i = 0; i < step_ids.size(); ++i) {
    step_ids[i] = static_cast<int64_t>(LoadLittleEndian64(reinterpret_cast<const uint8_t*>(bytes.data() + i * 8)));
  }
  return step_ids;
}

}  // namespace tf_rdma
