#include "cc/transport/verbs/verbs_messages.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
namespace {

constexpr size_t kRegionBodyLength = 24;

void PutLittle(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLittle(std::string_view in, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  return v;
}

}  // namespace

std::string EncodeRegion(const RegionMessage& region) {
  std::string out;
  out.push_back(static_cast<char>(kRegionMessageType));
  out.append(3, '\0');
  PutLittle(&out, kRegionBodyLength, 4);
  PutLittle(&out, region.region_id, 4);
  PutLittle(&out, region.rkey, 4);
  PutLittle(&out, region.address, 8);
  PutLittle(&out, region.size, 8);
  return out;
}

absl::StatusOr<Message> DecodeMessage(std::string_view bytes) {
  if (bytes.size() < wire::kHeaderLength) {
    return absl::DataLossError(absl::StrCat("message of ", bytes.size(), " bytes, shorter than a header"));
  }
  if (static_cast<uint8_t>(bytes[0]) == kRegionMessageType) {
    if (bytes.size() != wire::kHeaderLength + kRegionBodyLength || bytes[1] || bytes[2] || bytes[3] ||
        GetLittle(bytes, 4, 4) != kRegionBodyLength) {
      return absl::DataLossError("malformed REGION message");
    }
    const size_t b = wire::kHeaderLength;
    return RegionMessage{static_cast<uint32_t>(GetLittle(bytes, b, 4)),
                         static_cast<uint32_t>(GetLittle(bytes, b + 4, 4)), GetLittle(bytes, b + 8, 8),
                         GetLittle(bytes, b + 16, 8)};
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

}  // namespace tf_rdma::verbs
