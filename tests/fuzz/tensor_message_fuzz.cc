// A rendezvous tensor's header message (cc/tf/messages/tensor_message.h) as a peer may send it:
// decoded as the receiver decodes it, the tensor made from its inline bytes (TensorProto for
// string and variant tensors). What decodes must encode back to the same header, and a tensor
// made from it must travel again, alone and in a fused slot, and decode to the same dtype and shape.
#include <cstdint>
#include <string>
#include <vector>

#include "cc/tf/messages/tensor_message.h"
#include "tests/fuzz/tensor_from_peer.h"

namespace {

constexpr char kTarget[] = "tensor_message_fuzz";

void ExpectTravelsAgain(const tensorflow::Tensor& tensor) {
  tf_rdma::TensorHeader header;
  const std::string data = tf_rdma::fuzz::Reencoded(tensor, &header);
  std::string message = tf_rdma::EncodeHeader(header);
  if (tf_rdma::TravelsInline(header)) message += data;
  uint64_t data_offset = 0;
  absl::StatusOr<tf_rdma::TensorHeader> again = tf_rdma::DecodeHeader(message.data(), message.size(), &data_offset);
  if (!again.ok() || again->dtype != header.dtype || again->shape != header.shape || again->data_bytes != header.data_bytes) {
    tf_rdma::fuzz::Fail(kTarget, "a tensor made from a peer's message does not decode when sent again");
  }
  if (!tf_rdma::TravelsAsBytes(header.dtype) || !tf_rdma::TravelsInline(header)) return;
  const uint64_t capacity = tf_rdma::FusedSlotCapacity(header.shape.dims(), header.data_bytes);
  std::vector<char> slot(capacity);
  if (!tf_rdma::FillFusedSlot(slot.data(), capacity, header, data.data())) {
    tf_rdma::fuzz::Fail(kTarget, "a tensor does not fit the fused slot planned for its shape");
  }
  absl::StatusOr<std::string_view> member = tf_rdma::ReadFusedSlot(slot.data(), capacity);
  if (!member.ok() || *member != message) tf_rdma::fuzz::Fail(kTarget, "a fused slot does not give back its message");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* bytes = reinterpret_cast<const char*>(data);
  uint64_t data_offset = 0;
  absl::StatusOr<tf_rdma::TensorHeader> header = tf_rdma::DecodeHeader(bytes, size, &data_offset);
  if (!header.ok()) return 0;
  if (header->dead) return 0;
  if (data_offset > size) tf_rdma::fuzz::Fail(kTarget, "the data offset lies past the message");
  if (tf_rdma::EncodeHeader(*header) != std::string(bytes, data_offset)) {
    tf_rdma::fuzz::Fail(kTarget, "a decoded header does not encode to the bytes it came from");
  }
  if (!tf_rdma::TravelsInline(*header)) {
    if (data_offset != size) tf_rdma::fuzz::Fail(kTarget, "bytes after a header whose tensor travels apart");
    return 0;
  }
  absl::StatusOr<tensorflow::Tensor> tensor =
      tf_rdma::fuzz::TensorFromPeer(kTarget, *header, std::string_view(bytes + data_offset, size - data_offset));
  if (tensor.ok()) ExpectTravelsAgain(*tensor);
  return 0;
}
