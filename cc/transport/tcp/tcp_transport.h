// The tcp backend: RDMA's one-sided write emulated over one TCP stream per peer pair. The sender
// hands the kernel its message straight from the source memory (no staging copy), and the
// receiver reads the payload straight into the granted range (no intermediate buffer).
#ifndef TF_RDMA_CC_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <memory>
#include <string>

#include "cc/transport/transport.h"

namespace tf_rdma {

class StreamConnection;
struct PeerIdentity;

std::unique_ptr<Transport> CreateTcpTransport(const TransportOptions& options);
// A tcp connection over `fd` (a connected socket whose handshake is done; owned from now on), not
// yet served by an I/O loop (StreamConnection::Start). What the transport makes for each peer;
// also how tests/fuzz drives one event by event from a socketpair.
std::shared_ptr<StreamConnection> NewTcpConnection(int fd, const PeerIdentity& peer,
                                                   const std::string& peer_address,
                                                   const TransportOptions& options);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_TCP_TCP_TRANSPORT_H_
