// The control messages of a verbs connection, carried by SEND/RECV: the stream backends' wire
// frames (handshake, GRANT, TOO_SMALL, REVOKE, ...) unchanged, plus REGION, which tells the sender
// where a region the receiver grants from lives (address, size, rkey) once per connection.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MESSAGES_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MESSAGES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "absl/status/statusor.h"
#include "cc/transport/wire.h"

namespace tf_rdma::verbs {

// Outside wire::FrameType's range, so a verbs message never parses as a stream frame.
constexpr uint8_t kRegionMessageType = 0x40;
// Largest message: a wire frame with the largest body.
constexpr size_t kMaxMessageLength = wire::kHeaderLength + wire::kMaxBodyLength;

struct RegionMessage {
  uint32_t region_id = 0;
  uint32_t rkey = 0;
  uint64_t address = 0;
  uint64_t size = 0;
};

using Message = std::variant<wire::Frame, RegionMessage>;

std::string EncodeRegion(const RegionMessage& region);
// Parses one received message (untrusted): kDataLoss on anything malformed.
absl::StatusOr<Message> DecodeMessage(std::string_view bytes);

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MESSAGES_H_
