// The shm backend, for peers on the same host. Regions live in sealed memfd files; the first grant
// of a region passes its descriptor to the peer over the control socket (a Unix socket), and the
// peer maps it. A write is then one memcpy by the sender into the granted range, the same job a
// NIC's DMA does, and a DATA frame on the socket wakes the receiver: nobody spins.
#ifndef TF_RDMA_CC_TRANSPORT_SHM_SHM_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_SHM_SHM_TRANSPORT_H_

#include <memory>
#include <string>

#include "cc/transport/transport.h"

namespace tf_rdma {

class StreamConnection;
struct PeerIdentity;

// OK where this kernel gives shm its sealed memfd files; else why not.
absl::Status ShmAvailable();
std::unique_ptr<Transport> CreateShmTransport(const TransportOptions& options);
// A shm connection over `fd` (a connected Unix socket whose handshake is done; owned from now on),
// not yet served by an I/O loop (StreamConnection::Start). What the transport makes for each peer;
// also how tests/fuzz drives one event by event from a socketpair.
std::shared_ptr<StreamConnection> NewShmConnection(int fd, const PeerIdentity& peer,
                                                   const std::string& peer_address,
                                                   const TransportOptions& options);

// The abstract Unix socket name a shm listener for `port` binds.
std::string ShmSocketName(uint16_t port);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_SHM_SHM_TRANSPORT_H_
