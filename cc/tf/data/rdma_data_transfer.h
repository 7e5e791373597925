// tf_rdma's tf.data service data transfer protocol, "tf_rdma": registered with TensorFlow when the
// TensorFlow side of tf_rdma loads. Workers started with WorkerConfig(data_transfer_protocol=
// "tf_rdma") serve elements from a tf_rdma listener; trainers reading with distribute(...,
// data_transfer_protocol="tf_rdma") receive them into buffers they granted, and TensorFlow falls
// back to gRPC for workers without it (counted in tf_rdma.stats()).
#ifndef TF_RDMA_CC_TF_DATA_RDMA_DATA_TRANSFER_H_
#define TF_RDMA_CC_TF_DATA_RDMA_DATA_TRANSFER_H_

#include <map>
#include <string>

namespace tf_rdma {

inline constexpr char kDataTransferProtocol[] = "tf_rdma";
inline constexpr char kKindData[] = "data";  // stats(): bytes of tf.data service elements

// Trainers' fallbacks from "tf_rdma" to gRPC in this process, as TensorFlow counted them
// (/tensorflow/data/service/data_transfer_protocol_fallback): "<code>: <reason>" -> count.
std::map<std::string, uint64_t> DataTransferFallbacks();

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_DATA_RDMA_DATA_TRANSFER_H_
