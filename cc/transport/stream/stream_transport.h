// What the tcp and shm backends share above the connection: the I/O threads every connection is
// served from (io_loops.h), a listener that handshakes each accepted socket on a thread of its own
// once it sent its first byte (a slow or hostile client cannot stall the others, a silent one
// holds no thread), connects that retry until the peer is up and has a handshake slot free or
// TransportOptions::connect_timeout passes, and closing every connection when the transport goes
// away.
#ifndef TF_RDMA_CC_TRANSPORT_STREAM_STREAM_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_STREAM_STREAM_TRANSPORT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/transport/handshake.h"
#include "cc/transport/io_loops.h"
#include "cc/transport/stream/stream_connection.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

class StreamTransport : public Transport {
 public:
  ~StreamTransport() override;
  Backend backend() const override { return backend_; }
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Endpoint& endpoint, AcceptCallback on_accept,
                                                   AdmitCallback admit) override;
  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Endpoint& endpoint) override;

 protected:
  StreamTransport(Backend backend, const TransportOptions& options);

  // A listening socket for `endpoint`; `bound` is set to what peers must connect to.
  virtual absl::StatusOr<int> OpenListeningSocket(const Endpoint& endpoint, Endpoint* bound) = 0;
  // One attempt; kUnavailable means "not there yet, try again".
  virtual absl::StatusOr<int> ConnectSocket(const Endpoint& endpoint) = 0;
  virtual std::shared_ptr<StreamConnection> MakeConnection(int fd, const PeerIdentity& peer,
                                                           const std::string& peer_address) = 0;
  const TransportOptions& options() const { return options_; }

 private:
  absl::StatusOr<std::shared_ptr<StreamConnection>> StartConnection(int fd, const PeerIdentity& peer,
                                                                    const std::string& peer_address);
  // OK unless `name` holds TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME live connections already.
  absl::Status AdmitPeerName(const std::string& name);

  const Backend backend_;
  const TransportOptions options_;
  std::mutex mu_;
  std::vector<std::weak_ptr<StreamConnection>> connections_;
  // Last: its threads stop, after every connection was closed, before the rest goes.
  IoLoops loops_;
};

// Connections the tcp and shm backends started in this process, connected and accepted alike
// ("tcp_connections", "shm_connections"): counted across every transport, the Python bindings' and
// TensorFlow's.
std::map<std::string, uint64_t> StreamStatistics();

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_STREAM_STREAM_TRANSPORT_H_
