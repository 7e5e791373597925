// The tcp backend: RDMA's one-sided write emulated over one TCP stream per peer pair. The sender
// hands the kernel its message straight from the source memory (no staging copy), and the
// receiver reads the payload straight into the granted range (no intermediate buffer).
#ifndef TF_RDMA_CC_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <memory>

#include "cc/transport/transport.h"

namespace tf_rdma {

std::unique_ptr<Transport> CreateTcpTransport(const TransportOptions& options);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_TCP_TCP_TRANSPORT_H_
