// What the receivers (cc/tf/rendezvous/tensor_receive.cc, cc/tf/data/rdma_data_transfer.cc) make
// of a tensor whose header and inline bytes came from a peer, for the TensorFlow-side fuzz targets:
// the tensor, or the receiver's error. A tensor made must hold exactly the bytes its header said.
#ifndef TF_RDMA_TESTS_FUZZ_TENSOR_FROM_PEER_H_
#define TF_RDMA_TESTS_FUZZ_TENSOR_FROM_PEER_H_

#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cc/tf/messages/tensor_message.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor.pb.h"

namespace tf_rdma::fuzz {

[[noreturn]] inline void Fail(const char* target, const char* why) {
  __builtin_printf("%s: %s\n", target, why);
  std::abort();
}

inline absl::StatusOr<tensorflow::Tensor> TensorFromPeer(const char* target, const TensorHeader& header,
                                                         std::string_view bytes) {
  if (bytes.size() != header.data_bytes) Fail(target, "the decoder's inline bytes are not the header's count");
  if (!TravelsAsBytes(header.dtype)) {
    absl::StatusOr<tensorflow::Tensor> tensor = TensorFromProtoBytes(header, bytes);
    if (tensor.ok() && (tensor->dtype() != header.dtype || tensor->shape() != header.shape)) {
      Fail(target, "a TensorProto made a tensor other than its header's");
    }
    return tensor;
  }
  tensorflow::Tensor tensor(header.dtype, header.shape);
  if (tensor.TotalBytes() != bytes.size()) Fail(target, "a tensor's bytes are not its header's count");
  if (!bytes.empty()) std::memcpy(const_cast<char*>(tensor.tensor_data().data()), bytes.data(), bytes.size());
  return tensor;
}

// The tensor as its sender would send it: a header and the bytes that follow it.
inline std::string Reencoded(const tensorflow::Tensor& tensor, TensorHeader* header) {
  header->dead = false;
  header->dtype = tensor.dtype();
  header->shape = tensor.shape();
  if (TravelsAsBytes(tensor.dtype())) {
    header->data_bytes = tensor.tensor_data().size();
    return std::string(tensor.tensor_data());
  }
  tensorflow::TensorProto proto;
  tensor.AsProtoTensorContent(&proto);
  std::string bytes = proto.SerializeAsString();
  header->data_bytes = bytes.size();
  return bytes;
}

}  // namespace tf_rdma::fuzz

#endif  // TF_RDMA_TESTS_FUZZ_TENSOR_FROM_PEER_H_
