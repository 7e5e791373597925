#include "cc/transport/stream/stream_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/connect_retry.h"
#include "cc/transport/handshake_threads.h"
#include "cc/transport/stream/socket_io.h"

namespace tf_rdma {
namespace {

// Tells a client refused before its handshake started why, and closes it; never blocks the
// accept loop. What the client sent already is read first, a bounded amount (a HELLO is small),
// since closing a socket with unread data resets it and the client would lose the reason.
void RefuseBeforeHandshake(int client, const absl::Status& why) {
  const std::string reject = wire::Encode(
      {wire::FrameType::kReject, wire::Reject{static_cast<uint32_t>(why.code()), std::string(why.message())}});
  char sink[2 * wire::kMaxBodyLength];
  for (int round = 0; round < 4 && recv(client, sink, sizeof(sink), MSG_DONTWAIT) > 0; ++round) {
  }
  send(client, reject.data(), reject.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  close(client);
}

// Accepts on its own thread and handshakes each client on a thread of its own; joins them all when
// destroyed, so nothing it started outlives it. Running out of descriptors, threads or memory
// refuses clients for a while, never for good.
class StreamListener : public Listener {
 public:
  using Handshake = std::function<void(int fd)>;
  StreamListener(int fd, Endpoint endpoint, size_t max_concurrent_handshakes, Handshake handshake)
      : fd_(fd), endpoint_(std::move(endpoint)), handshake_(std::move(handshake)),
        handshakes_(std::in_place, max_concurrent_handshakes) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~StreamListener() override {
    {
      std::lock_guard<std::mutex> lock(stop_mu_);
      stopping_ = true;
    }
    stop_cv_.notify_all();
    shutdown(fd_, SHUT_RDWR);
    accept_thread_.join();
    handshakes_.reset();
    close(fd_);
  }
  Endpoint endpoint() const override { return endpoint_; }

 private:
  void AcceptLoop() {
    absl::Duration backoff = kFirstBackoff;
    while (!stopping_) {
      const int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        const int error = errno;
        if (stopping_) return;
        if (ResourceShortage(error)) {
          // What frees descriptors or memory (connections closing, handshakes timing out) takes
          // time; clients wait in the backlog meanwhile. Retrying at once would only spin.
          LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: cannot accept on " << endpoint_.ToString() << ": "
                                       << std::strerror(error) << "; retrying in "
                                       << absl::FormatDuration(backoff);
          WaitUnlessStopping(backoff);
          backoff = std::min(backoff * 2, kLastBackoff);
          continue;
        }
        if (ClientError(error)) continue;
        LOG(ERROR) << "tf_rdma: accept on " << endpoint_.ToString() << " failed: " << std::strerror(error)
                   << "; this listener stops accepting";
        return;
      }
      backoff = kFirstBackoff;
      absl::Status started = handshakes_->Start([this, client] { handshake_(client); });
      if (!started.ok()) {
        LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: refused a connection on " << endpoint_.ToString()
                                     << ": " << started;
        RefuseBeforeHandshake(client, started);
      }
    }
  }

  // accept errors that pass once descriptors, buffers or memory are freed.
  static bool ResourceShortage(int error) {
    return error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM;
  }
  // accept errors that concern one client only: Linux reports the new connection's pending network
  // errors through accept (see accept(2)), and a firewall may deny one (EPERM).
  static bool ClientError(int error) {
    switch (error) {
      case EINTR: case ECONNABORTED: case EPROTO: case ENOPROTOOPT: case EHOSTDOWN: case ENONET:
      case EHOSTUNREACH: case EOPNOTSUPP: case ENETDOWN: case ENETUNREACH: case EPERM: case ETIMEDOUT:
        return true;
      default:
        return false;
    }
  }

  void WaitUnlessStopping(absl::Duration duration) {
    std::unique_lock<std::mutex> lock(stop_mu_);
    stop_cv_.wait_for(lock, absl::ToChronoMilliseconds(duration), [this] { return stopping_.load(); });
  }

  static constexpr absl::Duration kFirstBackoff = absl::Milliseconds(10);
  static constexpr absl::Duration kLastBackoff = absl::Seconds(1);

  const int fd_;
  const Endpoint endpoint_;
  const Handshake handshake_;
  std::atomic<bool> stopping_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  std::optional<HandshakeThreads> handshakes_;  // reset: joined before fd_ closes
  std::thread accept_thread_;
};

// How an accepted peer is named in errors: its address, or its process for a Unix socket.
std::string DescribePeer(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  char host[INET6_ADDRSTRLEN] = "?";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    if (address.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
      inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
      return absl::StrCat(host, ":", ntohs(v4->sin_port));
    }
    if (address.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
      inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
      return absl::StrCat("[", host, "]:", ntohs(v6->sin6_port));
    }
  }
  ucred credentials{};
  socklen_t size = sizeof(credentials);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &size) == 0) {
    return absl::StrCat("local process ", credentials.pid);
  }
  return "an unknown address";
}

}  // namespace

StreamTransport::~StreamTransport() {
  std::vector<std::weak_ptr<StreamConnection>> connections;
  {
    std::lock_guard<std::mutex> lock(mu_);
    connections.swap(connections_);
  }
  for (auto& weak : connections) {
    if (auto connection = weak.lock()) {
      connection->Close(absl::CancelledError("the local tf_rdma transport shut down"));
    }
  }
}

absl::StatusOr<std::shared_ptr<StreamConnection>> StreamTransport::StartConnection(
    int fd, const PeerIdentity& peer, const std::string& peer_address) {
  absl::Status admitted = AdmitPeerName(peer.name);
  if (!admitted.ok()) {
    // Told to the peer, whose handshake succeeded: its connection ends with this reason.
    const std::string reject = wire::Encode(wire::Frame{
        wire::FrameType::kReject, wire::Reject{static_cast<uint32_t>(admitted.code()), std::string(admitted.message())}});
    send(fd, reject.data(), reject.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    close(fd);
    return admitted;
  }
  std::shared_ptr<StreamConnection> connection = MakeConnection(fd, peer, peer_address);
  absl::Status started = connection->Start();
  if (!started.ok()) return started;
  std::lock_guard<std::mutex> lock(mu_);
  connections_.erase(std::remove_if(connections_.begin(), connections_.end(),
                                    [](const auto& weak) { return weak.expired(); }),
                     connections_.end());
  connections_.push_back(connection);
  return connection;
}

// Checked before the connection starts; handshakes finishing at once may pass it together, so the
// most a name can hold is the limit plus TF_RDMA_MAX_CONCURRENT_HANDSHAKES.
absl::Status StreamTransport::AdmitPeerName(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t live = 0;
  for (const auto& weak : connections_) {
    std::shared_ptr<StreamConnection> connection = weak.lock();
    if (connection && connection->peer_name() == name && connection->health().ok()) ++live;
  }
  if (live < options_.limits.max_connections_per_peer_name) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "refused another ", BackendName(backend()), " connection with peer ", name, ": ", live,
      " live connections with peers of that name already, the limit TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME sets"));
}

absl::StatusOr<std::unique_ptr<Listener>> StreamTransport::Listen(const Endpoint& endpoint,
                                                                  AcceptCallback on_accept) {
  Endpoint bound;
  absl::StatusOr<int> fd = OpenListeningSocket(endpoint, &bound);
  if (!fd.ok()) return fd.status();
  auto handshake = [this, bound, on_accept = std::move(on_accept)](int client) {
    const std::string address = DescribePeer(client);
    SocketFrameChannel channel(client, address);
    absl::StatusOr<PeerIdentity> peer = ServerHandshake(channel, backend(), options_);
    if (!peer.ok()) {
      // A client that leaves without a word is a liveness probe (or a port scan), not news.
      if (peer.status().code() != absl::StatusCode::kUnavailable) {
        LOG(WARNING) << "tf_rdma: refused a " << BackendName(backend()) << " connection on "
                     << bound.ToString() << ": " << peer.status();
      }
      close(client);
      return;
    }
    absl::StatusOr<std::shared_ptr<StreamConnection>> connection = StartConnection(client, *peer, address);
    if (!connection.ok()) {
      LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: dropped a " << BackendName(backend())
                                   << " connection accepted on " << bound.ToString() << ": "
                                   << connection.status();
      return;
    }
    on_accept(*std::move(connection));
  };
  return std::make_unique<StreamListener>(*fd, bound, options_.limits.max_concurrent_handshakes,
                                          std::move(handshake));
}

absl::StatusOr<std::shared_ptr<Connection>> StreamTransport::Connect(const Endpoint& endpoint) {
  return ConnectWithRetries(backend(), endpoint, options_.connect_timeout, [&](absl::Time) -> ConnectAttempt {
    absl::StatusOr<int> fd = ConnectSocket(endpoint);
    // Nothing listening yet (kUnavailable) is worth another attempt; anything else is not.
    if (!fd.ok()) return {fd.status(), fd.status().code() == absl::StatusCode::kUnavailable};
    SocketFrameChannel channel(*fd, endpoint.ToString());
    absl::StatusOr<PeerIdentity> peer = ClientHandshake(channel, backend(), options_);
    if (!peer.ok()) {
      close(*fd);
      return {peer.status()};
    }
    absl::StatusOr<std::shared_ptr<StreamConnection>> connection = StartConnection(*fd, *peer, endpoint.ToString());
    if (!connection.ok()) return {connection.status()};
    return {std::shared_ptr<Connection>(*std::move(connection))};
  });
}

}  // namespace tf_rdma
