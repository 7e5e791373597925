// The errors every backend reports when a peer fails, worded once so users see the same message
// (naming the peer and the likely fix) whatever carries their tensors.
#ifndef TF_RDMA_CC_TRANSPORT_PEER_ERRORS_H_
#define TF_RDMA_CC_TRANSPORT_PEER_ERRORS_H_

#include <string>

#include "absl/status/status.h"

namespace tf_rdma {

// `cause` from the connection's own view: kDeadlineExceeded (the peer went silent), kDataLoss (it
// broke the protocol), kResourceExhausted (serving it ran into this process's limits: memory,
// mappings; kept as such, not reported as the peer's failure), anything else (the connection broke).
absl::Status PeerFailure(const std::string& peer_name, const std::string& peer_address,
                         const absl::Status& cause);

// The peer closed the connection and said why (`code`, `message` of its REJECT frame). Its
// protocol complaints about us are reported as kUnavailable: the broken party is not this process.
absl::Status PeerClosedConnection(const std::string& peer_name, const std::string& peer_address,
                                  uint32_t code, const std::string& message);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_PEER_ERRORS_H_
