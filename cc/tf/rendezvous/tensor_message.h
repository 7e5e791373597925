// How one tensor travels between an RdmaSend and an RdmaRecv kernel: two messages on the pair's
// connection, a small header (dead flag, dtype, shape, byte count) and the tensor's bytes, each
// under a tag both sides derive from the rendezvous identity of the transfer (devices,
// incarnation, tensor name, frame and iteration, step). The receiver grants both ahead of time,
// so in the steady state no message waits for a request.
#ifndef TF_RDMA_CC_TF_KERNELS_TRANSFER_H_
#define TF_RDMA_CC_TF_KERNELS_TRANSFER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "cc/transport/transport.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tf_rdma {

// Enough for a header with TensorShape's maximum rank.
// Set by the graph pass on a _Recv when the send side's static shape fixes the tensor's size.
constexpr char kPlannedBytesAttr[] = "_rdma_planned_bytes";
constexpr uint64_t kHeaderCapacity = 32 + 8 * tensorflow::TensorShape::MaxDimensions();

// What both kernels of a transfer read from their node: the rendezvous identity and the peer.
struct TransferIdentity {
  std::string key_prefix;
  std::string tensor_name;
  std::string peer_task;  // the other end: the receiver's task for a send, the sender's for a recv
};
absl::StatusOr<TransferIdentity> ReadTransferIdentity(tensorflow::OpKernelConstruction* ctx, bool sending);

struct TransferTags {
  Tag header;
  Tag data;
};

// `key_prefix` is "<send_device>;<incarnation>;<recv_device>;<tensor_name>", as TensorFlow's own
// rendezvous keys start.
std::string TransferKeyPrefix(const std::string& send_device, uint64_t incarnation,
                              const std::string& recv_device, const std::string& tensor_name);
TransferTags TagsFor(const std::string& key_prefix, int64_t step_id, uint64_t frame_id, int64_t iter_id);

struct TensorHeader {
  bool dead = false;
  tensorflow::DataType dtype = tensorflow::DT_INVALID;
  tensorflow::TensorShape shape;
  uint64_t data_bytes = 0;
};

std::string EncodeHeader(const TensorHeader& header);
// Checks everything against what the receiving kernel expects: the bytes come from another process.
absl::StatusOr<TensorHeader> DecodeHeader(const char* bytes, uint64_t length, tensorflow::DataType expected);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_KERNELS_TRANSFER_H_
