// How one rendezvous tensor travels: a small header (dead flag, dtype, shape, byte count) and the
// tensor's bytes, under tags both sides derive from the transfer's rendezvous key and step; a small
// tensor's bytes follow its header in the same message, a larger one's come as a second message.
// Tensors whose bytes are their value travel as they lie in memory; the others (string, variant)
// as their TensorProto, as gRPC would send them.
#ifndef TF_RDMA_CC_TF_MESSAGES_TENSOR_MESSAGE_H_
#define TF_RDMA_CC_TF_MESSAGES_TENSOR_MESSAGE_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cc/transport/transport.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tf_rdma {

// Enough for a header with TensorShape's maximum rank.
constexpr uint64_t kHeaderCapacity = 32 + 8 * tensorflow::TensorShape::MaxDimensions();
// Tensors of up to this many bytes travel inside their header's message: one grant and one write
// instead of two, where small tensors spend their time.
constexpr uint64_t kInlineBytes = 16 << 10;
// What a receiver grants for the header's message.
constexpr uint64_t kHeaderMessageCapacity = kHeaderCapacity + kInlineBytes;

struct TransferTags {
  Tag header;
  Tag data;
};

// How tf_rdma's messages store numbers, and how tags are taken from digests: little-endian.
// The 8 bytes at `bytes` as a number; `value`'s low `bytes` bytes appended to `out`.
uint64_t LoadLittleEndian64(const uint8_t* bytes);
void AppendLittleEndian(std::string& out, uint64_t value, int bytes);

// `transfer` is the rendezvous key (devices, incarnation, tensor name, frame and iteration).
TransferTags TagsFor(std::string_view transfer, int64_t step_id);
// One message carrying a collective's buffer: the collective's key names the buffer within a
// step; the devices say which direction.
Tag CollectiveTag(std::string_view key, int64_t step_id, std::string_view from_device,
                  std::string_view to_device);

// The tag of a fused message (cc/tf/planning/fusion.h): `group` names it within a step.
Tag FusedTag(uint64_t group, int64_t step_id, std::string_view from_device, std::string_view to_device);

struct TensorHeader {
  bool dead = false;
  tensorflow::DataType dtype = tensorflow::DT_INVALID;
  tensorflow::TensorShape shape;
  uint64_t data_bytes = 0;
};

// Whether the tensor's memory is its value (else it travels as a TensorProto).
bool TravelsAsBytes(tensorflow::DataType dtype);
// Whether the tensor's bytes follow its header in one message (else they come under the data tag).
bool TravelsInline(const TensorHeader& header);

// `room` more bytes are reserved, for inline data to follow without a reallocation.
std::string EncodeHeader(const TensorHeader& header, uint64_t room = 0);
// Checks everything: the bytes come from another process. A message of an inline tensor holds the
// header and then the tensor's `data_bytes`, which start at `*data_offset`.
absl::StatusOr<TensorHeader> DecodeHeader(const char* bytes, uint64_t length, uint64_t* data_offset);
// A string or variant tensor from the TensorProto a peer sent for `header` (DecodeHeader's). The
// proto's dtype and shape must be the header's before TensorFlow allocates anything for them.
absl::StatusOr<tensorflow::Tensor> TensorFromProtoBytes(const TensorHeader& header, std::string_view bytes);

// A fused message holds each member's header message (header and inline bytes, as above) in the
// slot planned for it: the message's length, then the message. Length 0 says the member travels on
// its own, under its own tags: it came larger than its static shape planned.
uint64_t FusedSlotCapacity(int dims, uint64_t data_bytes);
// Fills the slot with the member's message, or marks it as travelling on its own when the message
// does not fit; returns whether it fit. The slot's unused bytes are zeroed: nothing of this
// process's memory but the tensor goes to the peer.
bool FillFusedSlot(char* slot, uint64_t capacity, const TensorHeader& header, const char* data);
// The member's header message in a slot that came from the peer, checked against the slot's
// bounds; an empty view when the member travels on its own.
absl::StatusOr<std::string_view> ReadFusedSlot(const char* slot, uint64_t capacity);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_MESSAGES_TENSOR_MESSAGE_H_
