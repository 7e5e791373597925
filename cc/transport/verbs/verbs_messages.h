// The control messages of a verbs connection, carried by SEND/RECV: the stream backends' wire
// frames (handshake, TOO_SMALL, REVOKE, ...) unchanged, plus REGION, which tells the sender where a
// region the receiver grants from lives (address, size, rkey) once per connection, and GRANT_TABLE,
// which tells the peer where to write its grants (once per connection). A grant itself is a GRANT
// frame written by the granter into a slot of the peer's grant table (a grant record).
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
constexpr uint8_t kGrantTableMessageType = 0x41;
// Largest message: a wire frame with the largest body.
constexpr size_t kMaxMessageLength = wire::kHeaderLength + wire::kMaxBodyLength;

struct RegionMessage {
  uint32_t region_id = 0;
  uint32_t rkey = 0;
  uint64_t address = 0;
  uint64_t size = 0;
};

// One slot of a grant table holds one grant record: a GRANT frame as wire::Encode writes it.
constexpr size_t kGrantSlotSize = 64;
static_assert(kGrantSlotSize >= wire::kHeaderLength + sizeof(wire::Grant::grant_id) + sizeof(Tag) +
                                    sizeof(wire::Grant::region_id) + sizeof(wire::Grant::offset) +
                                    sizeof(wire::Grant::capacity));

struct GrantTableMessage {
  uint32_t slots = 0;  // of kGrantSlotSize bytes each
  uint32_t rkey = 0;
  uint64_t address = 0;
};

using Message = std::variant<wire::Frame, RegionMessage, GrantTableMessage>;

std::string EncodeRegion(const RegionMessage& region);
std::string EncodeGrantTable(const GrantTableMessage& table);
// Parses one received message (untrusted): kDataLoss on anything malformed.
absl::StatusOr<Message> DecodeMessage(std::string_view bytes);
// Set in the immediate of a grant record's write; the rest is the slot. Grant ids stay below it,
// so a data write's immediate (its grant id) cannot read as a grant record's.
constexpr uint32_t kGrantImmBit = uint32_t{1} << 31;
std::string EncodeGrantRecord(const wire::Grant& grant);
// Parses the bytes read from a grant table slot (untrusted): kDataLoss unless they are one GRANT.
absl::StatusOr<wire::Grant> DecodeGrantRecord(std::string_view bytes);

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MESSAGES_H_
