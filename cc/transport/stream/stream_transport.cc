#include "cc/transport/stream/stream_transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/log/log.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/addresses.h"
#include "cc/transport/connect_retry.h"
#include "cc/transport/handshake_threads.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/unlogged_count.h"

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

// Clients that every listener of this process holds before their first byte, counted together
// against the descriptors the process has left.
std::atomic<size_t> silent_clients{0};

// Descriptors this process has open; ResourceExhausted when no descriptor is left to list them
// with, Unavailable when they cannot be listed otherwise (no /proc in a sandbox).
absl::StatusOr<size_t> OpenDescriptors() {
  DIR* listing = opendir("/proc/self/fd");
  if (listing == nullptr) {
    const int error = errno;
    if (error == EMFILE || error == ENFILE) return absl::ResourceExhaustedError(ErrnoMessage("opendir", error));
    return absl::UnavailableError(ErrnoMessage("opendir(/proc/self/fd)", error));
  }
  size_t entries = 0;
  while (const dirent* entry = readdir(listing)) {
    if (entry->d_name[0] != '.') ++entries;
  }
  closedir(listing);
  return entries - 1;  // the listing's own
}

// Where an accepted client comes from, for the per-source limits: its IP address (any port), or
// for a Unix socket the user it runs as.
std::string SourceOf(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    std::string ip = IpAddressOf(reinterpret_cast<const sockaddr*>(&address));
    if (!ip.empty()) return ip;
  }
  ucred credentials{};
  socklen_t size = sizeof(credentials);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &size) == 0) {
    return absl::StrCat("local user ", credentials.uid);
  }
  return "an unknown address";
}

// Accepts on its own thread, and handshakes each client that sent its first byte on a thread of
// its own (HandshakeThreads); joins them all when destroyed, so nothing it started outlives it.
// A client that sends nothing holds only its descriptor, never a handshake slot, for at most
// kFirstByteDeadline. Such clients of all listeners together hold at most half the descriptors
// RLIMIT_NOFILE leaves the process beside everything else it has open (and at most kMaxWaiting),
// half of that from one source: the other half stays for connections and the shm regions their
// peers pass, however fast silent sockets arrive. Past it the one waiting longest goes, not the
// newcomer: a tf_rdma client speaks at once, so it is never the one waiting longest, while
// refusing newcomers would lock peers out for as long as a flood holds its places. Running out
// of descriptors, threads or memory refuses clients for a while, never for good.
class StreamListener : public Listener {
 public:
  using Handshake = std::function<void(int fd)>;
  StreamListener(int fd, int epoll_fd, int wake_fd, Endpoint endpoint, absl::Duration first_byte_deadline,
                 size_t max_concurrent_handshakes, Handshake handshake)
      : fd_(fd), epoll_fd_(epoll_fd), wake_fd_(wake_fd), endpoint_(std::move(endpoint)),
        first_byte_deadline_(first_byte_deadline), handshake_(std::move(handshake)),
        handshakes_(std::in_place, max_concurrent_handshakes) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~StreamListener() override {
    stopping_ = true;
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    accept_thread_.join();
    handshakes_.reset();
    for (const Waiting& waiting : waiting_) close(waiting.fd);
    silent_clients -= waiting_.size();
    close(wake_fd_);
    close(epoll_fd_);
    close(fd_);
  }
  Endpoint endpoint() const override { return endpoint_; }

  // The listener's epoll set: the listening socket, the stop signal and the waiting clients.
  static absl::StatusOr<std::pair<int, int>> MakeEventSources(int listening_fd) {
    const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd < 0) return absl::ResourceExhaustedError(ErrnoMessage("epoll_create1", errno));
    const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    epoll_event listening{};
    listening.events = EPOLLIN;
    listening.data.fd = listening_fd;
    epoll_event wake{};
    wake.events = EPOLLIN;
    wake.data.fd = wake_fd;
    if (wake_fd < 0 || epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listening_fd, &listening) != 0 ||
        epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &wake) != 0 ||
        fcntl(listening_fd, F_SETFL, fcntl(listening_fd, F_GETFL) | O_NONBLOCK) != 0) {
      const int error = errno;
      if (wake_fd >= 0) close(wake_fd);
      close(epoll_fd);
      return absl::ResourceExhaustedError(ErrnoMessage("cannot watch the listening socket", error));
    }
    return std::make_pair(epoll_fd, wake_fd);
  }

 private:
  struct Waiting {
    int fd;
    std::string source;
    absl::Time since;
  };

  void AcceptLoop() {
    absl::Duration backoff = kFirstBackoff;
    absl::Time accept_again = absl::InfinitePast();
    epoll_event events[64];
    while (!stopping_) {
      const absl::Time now = absl::Now();
      absl::Time wake_at = now + absl::Seconds(1);
      if (!waiting_.empty()) wake_at = std::min(wake_at, waiting_.front().since + first_byte_deadline_);
      if (accept_again > now) wake_at = std::min(wake_at, accept_again);
      const int timeout_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(wake_at - now) + 1);
      const int ready = epoll_wait(epoll_fd_, events, 64, timeout_ms);
      if (stopping_) return;
      bool listening_ready = false;
      for (int i = 0; i < std::max(ready, 0); ++i) {
        const int fd = events[i].data.fd;
        if (fd == fd_) {
          listening_ready = true;
        } else if (fd != wake_fd_) {
          FirstByte(fd);
        }
      }
      DropSilent(absl::Now());
      if ((listening_ready || accept_again != absl::InfinitePast()) && absl::Now() >= accept_again) {
        if (AcceptSome(backoff)) {
          accept_again = absl::InfinitePast();
          backoff = kFirstBackoff;
        } else {
          accept_again = absl::Now() + backoff;
          backoff = std::min(backoff * 2, kLastBackoff);
        }
      }
    }
  }

  // Accepts the clients waiting in the backlog, kAcceptsPerRound at most: the first bytes of
  // those accepted are seen to before more come, so a flood cannot push a peer that spoke out as
  // the one waiting longest. False when short of descriptors or memory (the rest wait in the
  // backlog until `backoff` passed: retrying at once would only spin).
  bool AcceptSome(absl::Duration backoff) {
    for (int round = 0; round < kAcceptsPerRound && !stopping_; ++round) {
      const int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        const int error = errno;
        if (error == EAGAIN || error == EWOULDBLOCK) return true;
        if ((error == EMFILE || error == ENFILE) && !waiting_.empty()) {
          // The oldest silent client's descriptor is worth less than the next client's.
          MakeRoom(waiting_.begin(), absl::ResourceExhaustedError(
                                         "the listener dropped this client, silent while the process ran out of "
                                         "descriptors"));
          counted_at_ = absl::InfinitePast();
          continue;
        }
        if (ResourceShortage(error)) {
          LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: cannot accept on " << endpoint_.ToString() << ": "
                                       << std::strerror(error) << "; retrying in "
                                       << absl::FormatDuration(backoff);
          return false;
        }
        if (ClientError(error)) continue;
        LOG(ERROR) << "tf_rdma: accept on " << endpoint_.ToString() << " failed: " << std::strerror(error)
                   << "; this listener stops accepting";
        stopping_ = true;
        return true;
      }
      Wait(client);
    }
    return true;
  }

  // Holds `client` until its first byte (or its hang-up) arrives, then makes room if need be: the
  // oldest from its source past that source's share, this listener's oldest past the process's.
  // Never the newcomer for the process's share: when the others are another listener's (a flood
  // on the tcp port, a peer dialling the shm one), that listener makes room at its next client,
  // so the share is passed by at most one client per listener.
  void Wait(int client) {
    epoll_event event{};
    event.events = EPOLLIN | EPOLLRDHUP;
    event.data.fd = client;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, client, &event) != 0) {
      RefuseBeforeHandshake(client, absl::ResourceExhaustedError(
                                        ErrnoMessage("the listener cannot watch the client", errno)));
      return;
    }
    waiting_.push_back(Waiting{client, SourceOf(client), absl::Now()});
    ++silent_clients;
    const size_t allowed = SilentClientsAllowed(waiting_.back().since);
    const std::string source = waiting_.back().source;
    const auto same_source = [&](const Waiting& w) { return w.source == source; };
    if (static_cast<size_t>(std::count_if(waiting_.begin(), waiting_.end(), same_source)) >
        std::max<size_t>(allowed / 2, 1)) {
      MakeRoom(std::find_if(waiting_.begin(), waiting_.end(), same_source), CrowdedOut(allowed));
    }
    while (silent_clients > allowed && waiting_.size() > 1) MakeRoom(waiting_.begin(), CrowdedOut(allowed));
  }

  static absl::Status CrowdedOut(size_t allowed) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the listener dropped this client, silent while clients that had not spoken held the ", allowed,
        " descriptors its process spares them (half of what RLIMIT_NOFILE leaves, at most ", kMaxWaiting, ")"));
  }

  // How many clients of the whole process may wait for their first byte: half the descriptors
  // that neither they nor anything else holds (RLIMIT_NOFILE less what is open), read when clients
  // come, at most every kRecount (listing /proc/self/fd costs a syscall per 32 or so descriptors).
  size_t SilentClientsAllowed(absl::Time now) {
    if (now - counted_at_ < kRecount) return allowed_;
    counted_at_ = now;
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
      allowed_ = kMaxWaiting;
      return allowed_;
    }
    const size_t most = limit.rlim_cur;
    const size_t silent = std::min<size_t>(silent_clients, most);
    const absl::StatusOr<size_t> open = OpenDescriptors();
    if (!open.ok() && !absl::IsResourceExhausted(open.status())) {
      allowed_ = std::min(kMaxWaiting, most / 2);  // uncountable here: the limit alone
      return allowed_;
    }
    // Unlistable for want of a descriptor: only what the silent clients hold can be spared.
    const size_t held_by_others = open.ok() ? *open - std::min(*open, silent) : most - silent;
    allowed_ = std::min(kMaxWaiting, (most - std::min(most, held_by_others)) / 2);
    return allowed_;
  }

  // Takes `waiting` off the waiting clients: dropped for `why`, unless it spoke since the last
  // epoll_wait (clients accepted in one round may all have), then its handshake starts.
  void MakeRoom(std::deque<Waiting>::iterator waiting, const absl::Status& why) {
    char byte;
    if (recv(waiting->fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      Drop(waiting, why);
    } else {
      FirstByte(waiting->fd);  // its bytes, its hang-up or its error: the handshake sees which
    }
  }

  // `fd` sent its first byte (or hung up): its handshake starts, if a slot is free.
  void FirstByte(int fd) {
    auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const Waiting& w) { return w.fd == fd; });
    if (it == waiting_.end()) return;
    Unwatch(fd);
    const std::string source = it->source;
    waiting_.erase(it);
    --silent_clients;
    absl::Status started = handshakes_->Start(source, [this, fd] { handshake_(fd); });
    if (!started.ok()) {
      LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: refused a connection on " << endpoint_.ToString()
                                   << ": " << started << " (the client tries again)";
      RefuseBeforeHandshake(fd, started);
    }
  }

  // Refuses a waiting client and forgets it.
  void Drop(std::deque<Waiting>::iterator waiting, const absl::Status& why) {
    Unwatch(waiting->fd);
    RefuseBeforeHandshake(waiting->fd, why);
    waiting_.erase(waiting);
    --silent_clients;
  }

  void DropSilent(absl::Time now) {
    while (!waiting_.empty() && now - waiting_.front().since >= first_byte_deadline_) {
      Drop(waiting_.begin(), absl::DeadlineExceededError(absl::StrCat("the client sent nothing within ",
                                                                      absl::FormatDuration(first_byte_deadline_),
                                                                      " of connecting")));
    }
  }

  void Unwatch(int fd) { epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr); }

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

  static constexpr absl::Duration kFirstBackoff = absl::Milliseconds(10);
  static constexpr absl::Duration kLastBackoff = absl::Seconds(1);
  static constexpr size_t kMaxWaiting = 4096;
  static constexpr int kAcceptsPerRound = 64;
  static constexpr absl::Duration kRecount = absl::Milliseconds(100);

  const int fd_;
  const int epoll_fd_;
  const int wake_fd_;
  const Endpoint endpoint_;
  const absl::Duration first_byte_deadline_;
  const Handshake handshake_;
  std::atomic<bool> stopping_{false};
  std::deque<Waiting> waiting_;  // oldest first; the accept thread's only
  absl::Time counted_at_ = absl::InfinitePast();  // SilentClientsAllowed's, the accept thread's only
  size_t allowed_ = kMaxWaiting;
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

std::atomic<uint64_t> tcp_connections_started{0};
std::atomic<uint64_t> shm_connections_started{0};

std::atomic<uint64_t>& ConnectionsStarted(Backend backend) {
  return backend == Backend::kShm ? shm_connections_started : tcp_connections_started;
}

}  // namespace

StreamTransport::StreamTransport(Backend backend, const TransportOptions& options)
    : backend_(backend),
      options_(options),
      // Ticks often enough that a silent peer is noticed within an eighth of the timeout of it.
      loops_(std::max<size_t>(options.io_threads, 1), options.peer_timeout / 8, options.stream_poll_window) {
  // Threads short now: connections try again when they come (IoLoops::Next).
  absl::Status started = loops_.Start();
  if (!started.ok()) LOG(WARNING) << "tf_rdma: " << started;
}

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
  absl::StatusOr<std::shared_ptr<IoLoop>> loop = loops_.Next();
  if (!loop.ok()) {
    connection->Close(loop.status());
    return loop.status();
  }
  absl::Status started = connection->Start(*std::move(loop));
  if (!started.ok()) return started;
  std::lock_guard<std::mutex> lock(mu_);
  connections_.erase(std::remove_if(connections_.begin(), connections_.end(),
                                    [](const auto& weak) { return weak.expired(); }),
                     connections_.end());
  connections_.push_back(connection);
  ConnectionsStarted(backend_).fetch_add(1, std::memory_order_relaxed);
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
                                                                  AcceptCallback on_accept, AdmitCallback admit) {
  Endpoint bound;
  absl::StatusOr<int> fd = OpenListeningSocket(endpoint, &bound);
  if (!fd.ok()) return fd.status();
  auto handshake = [this, bound, on_accept = std::move(on_accept), admit = std::move(admit)](int client) {
    const std::string address = DescribePeer(client);
    SocketFrameChannel channel(client, address);
    absl::StatusOr<PeerIdentity> peer = ServerHandshake(channel, backend(), options_, admit);
    if (!peer.ok()) {
      // A client that leaves without a word is a liveness probe (or a port scan), not news; one
      // told "not now" by the admission (kUnavailable too) tries again, and is not news either.
      // Rate-limited as accept errors are: clients with a wrong key can refuse themselves by the
      // thousand a second, and each line would be theirs to write.
      static UnloggedCount refusals;
      if (peer.status().code() != absl::StatusCode::kUnavailable) {
        refusals.Occurred();
        LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: refused a " << BackendName(backend()) << " connection on "
                                     << bound.ToString() << ": " << peer.status() << refusals.SinceLastLine();
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
  absl::StatusOr<std::pair<int, int>> sources = StreamListener::MakeEventSources(*fd);
  if (!sources.ok()) {
    close(*fd);
    return sources.status();
  }
  // A client sends its HELLO as soon as it connected: one that has not within two seconds (or the
  // connect timeout, if shorter) is not a tf_rdma peer, or not a working one.
  const absl::Duration first_byte_deadline = std::min(absl::Seconds(2), options_.connect_timeout);
  return std::make_unique<StreamListener>(*fd, sources->first, sources->second, bound, first_byte_deadline,
                                          options_.limits.max_concurrent_handshakes, std::move(handshake));
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
      // A listener short of handshake slots (a connection storm) refuses before the handshake: a
      // slot frees within a handshake's time, so that is worth another attempt; so is a
      // listener's admission saying "not now". Both are RefusedForNow.
      return {peer.status(), RefusedForNow(peer.status())};
    }
    absl::StatusOr<std::shared_ptr<StreamConnection>> connection = StartConnection(*fd, *peer, endpoint.ToString());
    if (!connection.ok()) return {connection.status()};
    return {std::shared_ptr<Connection>(*std::move(connection))};
  });
}

std::map<std::string, uint64_t> StreamStatistics() {
  return {{"tcp_connections", tcp_connections_started.load(std::memory_order_relaxed)},
          {"shm_connections", shm_connections_started.load(std::memory_order_relaxed)}};
}

}  // namespace tf_rdma
