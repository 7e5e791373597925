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

// `requested` is TF_RDMA_BACKEND's value. auto: the registered backend of lowest auto_rank that
// works here with `options` and reaches the peer (shm for a peer on this host, else verbs where an
// RDMA device reaches it, else tcp); its reason names why those before it were passed over. An
// explicit backend that cannot work here, or serves only this host's peers and the peer is on
// another, is an error naming why.
absl::StatusOr<BackendChoice> ChooseBackend(const std::string& requested, const std::string& peer_host,
                                            const TransportOptions& options);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_BACKEND_SELECTION_H_
