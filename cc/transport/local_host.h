#ifndef TF_RDMA_CC_TRANSPORT_LOCAL_HOST_H_
#define TF_RDMA_CC_TRANSPORT_LOCAL_HOST_H_

#include <string>

#include "absl/status/statusor.h"

namespace tf_rdma {

// Whether `host` (name or address) resolves to this machine: a loopback address or one bound to a
// local interface. Fails when the name does not resolve.
absl::StatusOr<bool> IsLocalHost(const std::string& host);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_LOCAL_HOST_H_
