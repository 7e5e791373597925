// How the rendezvous names a transfer: the task at each end, its kind (for the stats), and the
// name a loop's iterations have in common.
#ifndef TF_RDMA_CC_TF_RENDEZVOUS_TRANSFER_NAMES_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_TRANSFER_NAMES_H_

#include <string>
#include <string_view>

#include "tensorflow/core/util/device_name_utils.h"

namespace tf_rdma {

std::string TaskName(const tensorflow::DeviceNameUtils::ParsedName& device);

// Graph partitions name their transfers edge_<id>_<node>; eager copies do not: kKindGraph or
// kKindEager (cc/tf/runtime/stats.h).
const char* KindOf(std::string_view tensor_name);

// The transfer without its frame and iteration: what a loop's iterations have in common, so the
// size one iteration carried is the grant of the next.
std::string TransferName(std::string_view full_key);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_TRANSFER_NAMES_H_
