#include "cc/transport/tcp/tcp_transport.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cc/transport/addresses.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/stream/stream_transport.h"

namespace tf_rdma {
namespace {

class PageRegion : public MemoryRegion {
 public:
  PageRegion(uint32_t id, char* data, size_t size) : MemoryRegion(id, data, size) {}
  ~PageRegion() override { munmap(data(), size()); }
};

class TcpConnection : public StreamConnection {
 public:
  using StreamConnection::StreamConnection;

 protected:
  absl::StatusOr<bool> PlaceMessage(const wire::Grant&, const void*, uint64_t) override {
    return true;  // the payload follows its DATA frame on the socket
  }
  bool PayloadOnStream() const override { return true; }
};

void Tune(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

class TcpTransport : public StreamTransport {
 public:
  explicit TcpTransport(const TransportOptions& options) : StreamTransport(Backend::kTcp, options) {}

  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateRegion(size_t bytes) override {
    void* data = mmap(nullptr, std::max<size_t>(bytes, 1), PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate a region of ", bytes, " bytes: ", std::strerror(errno)));
    }
    return std::make_shared<PageRegion>(next_region_id_++, static_cast<char*>(data), bytes);
  }

 protected:
  absl::StatusOr<int> OpenListeningSocket(const Endpoint& endpoint, Endpoint* bound) override {
    absl::StatusOr<AddressList> resolved = ResolveEndpoint(endpoint, true);
    if (!resolved.ok()) return resolved.status();
    absl::Status last = absl::UnavailableError("no address to listen on");
    int fd = -1;
    for (addrinfo* a = resolved->get(); a != nullptr && fd < 0; a = a->ai_next) {
      fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
        last = absl::UnavailableError(absl::StrCat(
            "cannot listen on ", endpoint.ToString(), ": ", std::strerror(errno),
            errno == EADDRINUSE ? " (another socket holds the port: another process, or another server of this one; pick another)" : ""));
        close(fd);
        fd = -1;
      }
    }
    if (fd < 0) return last;
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    const uint16_t port = address.ss_family == AF_INET
                              ? ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port)
                              : ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
    *bound = Endpoint{endpoint.host.empty() ? "0.0.0.0" : endpoint.host, port};
    return fd;
  }

  absl::StatusOr<int> ConnectSocket(const Endpoint& endpoint) override {
    absl::StatusOr<AddressList> resolved = ResolveEndpoint(endpoint, false);
    if (!resolved.ok()) return resolved.status();
    absl::Status last = absl::UnavailableError("no address");
    int fd = -1;
    for (addrinfo* a = resolved->get(); a != nullptr && fd < 0; a = a->ai_next) {
      fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      // Bounds a connect to a host that does not answer at all.
      timeval limit = absl::ToTimeval(options().connect_timeout);
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
      if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        last = absl::UnavailableError(ErrnoMessage("connect", errno));
        close(fd);
        fd = -1;
        continue;
      }
      timeval none{};
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
      Tune(fd);
    }
    if (fd < 0) return last;
    return fd;
  }

  std::shared_ptr<StreamConnection> MakeConnection(int fd, const PeerIdentity& peer,
                                                   const std::string& peer_address) override {
    return NewTcpConnection(fd, peer, peer_address, options());
  }

 private:
  std::atomic<uint32_t> next_region_id_{1};
};

}  // namespace

std::unique_ptr<Transport> CreateTcpTransport(const TransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

std::shared_ptr<StreamConnection> NewTcpConnection(int fd, const PeerIdentity& peer,
                                                   const std::string& peer_address,
                                                   const TransportOptions& options) {
  Tune(fd);
  return std::make_shared<TcpConnection>(fd, Backend::kTcp, peer, peer_address, options);
}

}  // namespace tf_rdma
