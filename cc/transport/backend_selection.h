#ifndef TF_RDMA_CC_TRANSPORT_BACKEND_SELECTION_H_
#define TF_RDMA_CC_TRANSPORT_BACKEND_SELECTION_H_

#include <string>

#include "absl/status/statusor.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

struct BackendChoice {
  Backend backend;
  std::string reason;  // for the log line that says which backend a peer got, and why
};

// `requested` is TF_RDMA_BACKEND's value. auto: shm for a peer on this host, else verbs where it
// works, else tcp. An explicit backend that cannot reach the peer is an error naming why.
absl::StatusOr<BackendChoice> ChooseBackend(const std::string& requested, const std::string& peer_host);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_BACKEND_SELECTION_H_
