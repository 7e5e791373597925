// The frames two tf_rdma processes exchange on a stream (tcp socket, shm control socket).
//
// Every frame is an 8-byte header {u8 type, u8[3] zero, u32 body length (little endian)} and a body
// of at most kMaxBodyLength bytes; a DATA frame on tcp is followed by its payload, which is not part
// of the body. Everything read off the wire is untrusted: decoding checks every length and field and
// fails with kDataLoss instead of touching memory it should not.
#ifndef TF_RDMA_CC_TRANSPORT_WIRE_H_
#define TF_RDMA_CC_TRANSPORT_WIRE_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "absl/status/statusor.h"
#include "cc/transport/transport.h"

namespace tf_rdma::wire {

// Bumped whenever a frame's layout or meaning changes, or what the messages above them say (a
// control call's methods: cc/tf/calls/call_methods.h); peers must agree exactly.
constexpr uint32_t kProtocolVersion = 8;
constexpr size_t kHeaderLength = 8;
constexpr uint32_t kMaxBodyLength = 4096;
constexpr size_t kMaxNameLength = 512;
constexpr size_t kNonceLength = 32;
constexpr size_t kMacLength = 32;
// A WITHDRAWN's reason: enough for a status message naming a task and its failure; longer ones are
// cut when sent and refused when received, so a peer cannot make every answered grant hold KiBs.
constexpr size_t kMaxWithdrawnReasonLength = 256;

enum class FrameType : uint8_t {
  kHello = 1,      // client -> server: who I am, my nonce
  kChallenge = 2,  // server -> client: who I am, my nonce
  kProof = 3,      // client -> server: proof that I hold the cluster key
  kAccept = 4,     // server -> client: handshake done, and proof that I hold the key too
  kReject = 5,     // either way: why the connection is refused or ended
  kGrant = 6,      // receiver -> sender: a destination for one tagged message
  kData = 7,       // sender -> receiver: a granted message landed (tcp: payload follows)
  kTooSmall = 8,   // sender -> receiver: the message needs a bigger grant
  kRevoke = 9,     // receiver -> sender: give this grant back
  kRevoked = 10,   // sender -> receiver: the grant is given back unused
  kPing = 11,      // either way: I am alive
  kShmRegion = 12, // receiver -> sender (shm): a region's file descriptor rides along
  kDiscard = 13,   // receiver -> sender: no message under this tag is wanted any more
  kShmRegionGone = 14,  // receiver -> sender (shm): a region is freed, no grant into it is out: unmap it
  kWithdrawn = 15,  // sender -> receiver: the message this grant waits for will never come, and why
};

using Nonce = std::array<uint8_t, kNonceLength>;
using Mac = std::array<uint8_t, kMacLength>;

struct Header {
  FrameType type;
  uint32_t body_length;
};

// kHello and kChallenge.
struct Greeting {
  uint32_t protocol_version = kProtocolVersion;
  uint8_t backend = 0;
  Nonce nonce{};
  std::string name;   // the sender's TransportOptions::local_name, unprintable bytes escaped
  // The name's bytes as they travelled (decoding only): what the handshake's tokens cover.
  std::string name_on_wire;
  std::string build;  // the sender's tf_rdma version, for error messages
};
struct Proof { Mac mac{}; };
struct Accept { Mac mac{}; };
struct Reject {
  uint32_t code = 0;  // absl::StatusCode
  std::string message;
};
struct Grant {
  uint64_t grant_id = 0;
  Tag tag;
  uint32_t region_id = 0;
  uint64_t offset = 0;
  uint64_t capacity = 0;
};
struct Data {
  uint64_t grant_id = 0;
  uint64_t length = 0;
};
struct TooSmall {
  uint64_t grant_id = 0;
  uint64_t needed = 0;
};
struct Revoke { uint64_t grant_id = 0; };
struct Revoked { uint64_t grant_id = 0; };
struct Ping {};
struct Discard { Tag tag; };
struct ShmRegion {
  uint32_t region_id = 0;
  uint64_t size = 0;
};
struct ShmRegionGone { uint32_t region_id = 0; };
struct Withdrawn {
  uint64_t grant_id = 0;
  uint32_t code = 0;   // absl::StatusCode of why the sender withdrew the message; never OK
  std::string reason;  // decoded: unprintable bytes escaped (it is the peer's text)
};

using Body = std::variant<Greeting, Proof, Accept, Reject, Grant, Data, TooSmall, Revoke, Revoked,
                          Ping, ShmRegion, Discard, ShmRegionGone, Withdrawn>;
struct Frame {
  FrameType type;
  Body body;
};

absl::StatusOr<Header> DecodeHeader(std::string_view bytes);
absl::StatusOr<Frame> DecodeBody(FrameType type, std::string_view body);

// Header and body of `frame`, ready to send.
std::string Encode(const Frame& frame);

const char* FrameTypeName(FrameType type);

// The bytes of `name` a Greeting carries (it is cut at kMaxNameLength).
std::string NameOnWire(const std::string& name);

}  // namespace tf_rdma::wire

#endif  // TF_RDMA_CC_TRANSPORT_WIRE_H_
