#include "cc/transport/verbs/verbs_messages.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
namespace {

constexpr size_t kRegionBodyLength = 24;
constexpr size_t kGrantTableBodyLength = 16;

void PutLittle(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLittle(std::string_view in, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  return v;
}

std::string Header(uint8_t type, size_t body_length) {
  std::string out;
  out.push_back(static_cast<char>(type));
  out.append(3, '\0');
  PutLittle(&out, body_length, 4);
  return out;
}

bool HasHeader(std::string_view bytes, uint8_t type, size_t body_length) {
  return bytes.size() == wire::kHeaderLength + body_length && static_cast<uint8_t>(bytes[0]) == type &&
         !bytes[1] && !bytes[2] && !bytes[3] && GetLittle(bytes, 4, 4) == body_length;
}

}  // namespace

std::string EncodeRegion(const RegionMessage& region) {
  std::string out = Header(kRegionMessageType, kRegionBodyLength);
  PutLittle(&out, region.region_id, 4);
  PutLittle(&out, region.rkey, 4);
  PutLittle(&out, region.address, 8);
  PutLittle(&out, region.size, 8);
  return out;
}

std::string EncodeGrantTable(const GrantTableMessage& table) {
  std::string out = Header(kGrantTableMessageType, kGrantTableBodyLength);
  PutLittle(&out, table.slots, 4);
  PutLittle(&out, table.rkey, 4);
  PutLittle(&out, table.address, 8);
  return out;
}

absl::StatusOr<Message> DecodeMessage(std::string_view bytes) {
  if (bytes.size() < wire::kHeaderLength) {
    return absl::DataLossError(absl::StrCat("message of ", bytes.size(), " bytes, shorter than a header"));
  }
  const size_t b = wire::kHeaderLength;
  if (static_cast<uint8_t>(bytes[0]) == kRegionMessageType) {
    if (!HasHeader(bytes, kRegionMessageType, kRegionBodyLength)) {
      return absl::DataLossError("malformed REGION message");
    }
    return RegionMessage{static_cast<uint32_t>(GetLittle(bytes, b, 4)),
                         static_cast<uint32_t>(GetLittle(bytes, b + 4, 4)), GetLittle(bytes, b + 8, 8),
                         GetLittle(bytes, b + 16, 8)};
  }
  if (static_cast<uint8_t>(bytes[0]) == kGrantTableMessageType) {
    if (!HasHeader(bytes, kGrantTableMessageType, kGrantTableBodyLength)) {
      return absl::DataLossError("malformed GRANT_TABLE message");
    }
    return GrantTableMessage{static_cast<uint32_t>(GetLittle(bytes, b, 4)),
                             static_cast<uint32_t>(GetLittle(bytes, b + 4, 4)), GetLittle(bytes, b + 8, 8)};
  }
  absl::StatusOr<wire::Header> header = wire::DecodeHeader(bytes.substr(0, wire::kHeaderLength));
  if (!header.ok()) return header.status();
  const std::string_view body = bytes.substr(wire::kHeaderLength);
  if (body.size() != header->body_length) {
    return absl::DataLossError(absl::StrCat("message body is ", body.size(), " bytes, its header says ",
                                            header->body_length));
  }
  absl::StatusOr<wire::Frame> frame = wire::DecodeBody(header->type, body);
  if (!frame.ok()) return frame.status();
  return *std::move(frame);
}

std::string EncodeGrantRecord(const wire::Grant& grant) {
  return wire::Encode({wire::FrameType::kGrant, grant});
}

absl::StatusOr<wire::Grant> DecodeGrantRecord(std::string_view bytes) {
  absl::StatusOr<Message> message = DecodeMessage(bytes);
  if (!message.ok()) return message.status();
  const auto* frame = std::get_if<wire::Frame>(&*message);
  if (frame == nullptr || frame->type != wire::FrameType::kGrant) {
    return absl::DataLossError("a grant table slot holds something other than a GRANT");
  }
  return std::get<wire::Grant>(frame->body);
}

}  // namespace tf_rdma::verbs
