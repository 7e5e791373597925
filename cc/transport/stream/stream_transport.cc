#include "cc/transport/stream/stream_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/handshake_threads.h"
#include "cc/transport/stream/socket_io.h"

namespace tf_rdma {
namespace {

// Accepts on its own thread and handshakes each client on a thread of its own; joins them all when
// destroyed, so nothing it started outlives it.
class StreamListener : public Listener {
 public:
  using Handshake = std::function<void(int fd)>;
  StreamListener(int fd, Endpoint endpoint, Handshake handshake)
      : fd_(fd), endpoint_(std::move(endpoint)), handshake_(std::move(handshake)) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~StreamListener() override {
    stopping_ = true;
    shutdown(fd_, SHUT_RDWR);
    accept_thread_.join();
    handshakes_.reset();
    close(fd_);
  }
  Endpoint endpoint() const override { return endpoint_; }

 private:
  void AcceptLoop() {
    while (!stopping_) {
      const int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (!stopping_) LOG(ERROR) << "tf_rdma: accept on " << endpoint_.ToString() << ": " << std::strerror(errno);
        return;
      }
      handshakes_->Start([this, client] { handshake_(client); });
    }
  }

  const int fd_;
  const Endpoint endpoint_;
  const Handshake handshake_;
  std::atomic<bool> stopping_{false};
  std::optional<HandshakeThreads> handshakes_{std::in_place};  // reset: joined before fd_ closes
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

std::shared_ptr<StreamConnection> StreamTransport::StartConnection(int fd, const PeerIdentity& peer,
                                                                   const std::string& peer_address) {
  std::shared_ptr<StreamConnection> connection = MakeConnection(fd, peer, peer_address);
  connection->Start();
  std::lock_guard<std::mutex> lock(mu_);
  connections_.erase(std::remove_if(connections_.begin(), connections_.end(),
                                    [](const auto& weak) { return weak.expired(); }),
                     connections_.end());
  connections_.push_back(connection);
  return connection;
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
    on_accept(StartConnection(client, *peer, address));
  };
  return std::make_unique<StreamListener>(*fd, bound, std::move(handshake));
}

absl::StatusOr<std::shared_ptr<Connection>> StreamTransport::Connect(const Endpoint& endpoint) {
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::Duration backoff = absl::Milliseconds(10);
  while (true) {
    absl::StatusOr<int> fd = ConnectSocket(endpoint);
    if (fd.ok()) {
      SocketFrameChannel channel(*fd, endpoint.ToString());
      absl::StatusOr<PeerIdentity> peer = ClientHandshake(channel, backend(), options_);
      if (!peer.ok()) {
        close(*fd);
        return peer.status();
      }
      return StartConnection(*fd, *peer, endpoint.ToString());
    }
    // Peers start in any order: a peer that is not listening yet is retried until the deadline.
    if (fd.status().code() != absl::StatusCode::kUnavailable) return fd.status();
    if (absl::Now() + backoff > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "could not reach the tf_rdma ", BackendName(backend()), " listener of peer ",
          endpoint.ToString(), " within ", absl::FormatDuration(options_.connect_timeout),
          " (TF_RDMA_CONNECT_TIMEOUT_MS): ", fd.status().message(),
          ". Is the peer running, with tf_rdma loaded?"));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
}

}  // namespace tf_rdma
