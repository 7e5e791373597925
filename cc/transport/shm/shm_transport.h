// The shm backend, for peers on the same host. Regions live in sealed memfd files; the first grant
// of a region passes its descriptor to the peer over the control socket (a Unix socket), and the
// peer maps it. A write is then one memcpy by the sender into the granted range, the same job a
// NIC's DMA does, and a DATA frame on the socket wakes the receiver: nobody spins.
#ifndef TF_RDMA_CC_TRANSPORT_SHM_SHM_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_SHM_SHM_TRANSPORT_H_

#include <memory>

#include "cc/transport/transport.h"

namespace tf_rdma {

// OK where this kernel gives shm its sealed memfd files; else why not.
absl::Status ShmAvailable();
std::unique_ptr<Transport> CreateShmTransport(const TransportOptions& options);

// The abstract Unix socket name a shm listener for `port` binds.
std::string ShmSocketName(uint16_t port);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_SHM_SHM_TRANSPORT_H_
