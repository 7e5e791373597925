// How Connections makes a connection: the task that sorts first dials (ConnectTo), the other waits
// for its dial (AwaitFrom); either one diagnoses a peer that does not come (not running, running
// TensorFlow without tf_rdma, or the server of a task named otherwise).
#include "cc/tf/runtime/connections.h"

#include <arpa/inet.h>
#include <cerrno>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/addresses.h"
#include "cc/transport/backend_registry.h"
#include "cc/transport/connect_retry.h"

namespace tf_rdma {
namespace {

// What a TCP connect to host:port met within a limit: a listener, a refusal (the host is up and
// nothing listens there: a process that ran there died), or nothing (a frozen process whose
// backlog is full, a lost link, an unknown name).
enum class PortState { kAnswers, kRefuses, kSilent };

PortState Probe(const std::string& host, uint16_t port, absl::Duration limit) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &resolved) != 0) return PortState::kSilent;
  PortState state = PortState::kSilent;
  for (addrinfo* a = resolved; a != nullptr && state != PortState::kAnswers; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int error = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      state = PortState::kAnswers;
    } else if (errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      socklen_t length = sizeof(error);
      if (poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(limit))) == 1 &&
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0) {
        if (error == 0) state = PortState::kAnswers;
      }
    } else {
      error = errno;
    }
    if (error == ECONNREFUSED && state == PortState::kSilent) state = PortState::kRefuses;
    close(fd);
  }
  freeaddrinfo(resolved);
  return state;
}

// Whether something accepts TCP connections at host:port, within `limit`.
bool Answers(const std::string& host, uint16_t port, absl::Duration limit) {
  return Probe(host, port, limit) == PortState::kAnswers;
}

// Why `peer` did not connect or could not be reached: OK if its tf_rdma listener answers;
// kFailedPrecondition if only its TensorFlow server does (it runs without tf_rdma), else
// kUnavailable with `cause`.
absl::Status DiagnoseMissingPeer(const TaskAddress& peer, const absl::Status& cause) {
  if (Answers(peer.host, peer.rdma_port, absl::Seconds(1))) return absl::OkStatus();
  if (Answers(peer.host, peer.grpc_port, absl::Seconds(1))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", peer.task, " runs TensorFlow without tf_rdma: its TensorFlow server answers at ",
        peer.host, ":", peer.grpc_port, " but nothing listens on its tf_rdma port ", peer.rdma_port,
        ". Start every task of the cluster with tf_rdma (tf_rdma.Server, or the strategy's tf_rdma drop-in) and the same TF_RDMA_PORT_OFFSET."));
  }
  return absl::UnavailableError(absl::StrCat("task ", peer.task, " is unreachable at ", peer.host,
                                             ":", peer.rdma_port, ": ", cause.message()));
}

}  // namespace

void Connections::Establish(const std::string& peer_task) {
  const std::optional<TaskAddress> address = addresses_.Find(peer_task);
  absl::StatusOr<std::shared_ptr<Connection>> result;
  if (peer_task < local_task_) {
    result = AwaitFrom(peer_task);
  } else if (address) {
    result = ConnectTo(*address);
  } else {
    result = absl::NotFoundError(absl::StrCat(
        "task ", peer_task, " is in no cluster definition this server (", local_task_,
        ") has seen, so its tf_rdma address is unknown"));
  }
  std::vector<ConnectionCallback> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_.at(peer_task);
    peer.connecting = false;
    peer.dial_asks = 0;
    if (result.ok() && peer.connection != *result) {
      if (peer.connection) RetireLocked(peer.connection, absl::UnavailableError("replaced by a new connection"));
      AdoptLocked(peer_task, peer, *result);
    }
    if (result.ok()) peer.was_connected = true;
    waiters.swap(peer.waiters);
  }
  if (!result.ok()) {
    LOG(ERROR) << "tf_rdma: no connection to task " << peer_task << ": " << result.status();
    stats_.Peer(peer_task, [](PeerStats& s) { s.errors++; });
  }
  for (auto& waiter : waiters) waiter(result);
}

absl::StatusOr<std::shared_ptr<Connection>> Connections::ConnectTo(const TaskAddress& peer) {
  absl::StatusOr<std::pair<Transport*, BackendChoice>> route = transports_.To(peer.host);
  if (!route.ok()) return route.status();
  const auto& [transport, choice] = *route;
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  // The transport retries a peer that is not listening yet; one that answers and then fails at
  // once (it hangs up, or is still starting) is retried here, and must not be in a tight loop.
  ConnectBackoff backoff(deadline);
  while (true) {
    absl::StatusOr<std::shared_ptr<Connection>> connection =
        transport->Connect(Endpoint{peer.host, peer.rdma_port});
    if (connection.ok() && (*connection)->peer_name() != peer.task) {
      const std::string identity = (*connection)->peer_name();
      (*connection)->Close(absl::FailedPreconditionError("not the task dialled"));
      return addresses_.MarkRenamed(peer, identity);
    }
    if (connection.ok()) {
      LOG(INFO) << absl::StrCat("tf_rdma: ", BackendName(choice.backend), " to task ", peer.task, " at ",
                                peer.host, ":", peer.rdma_port, " (", choice.reason, ")");
      RecordConnection(peer.task, choice.backend, choice.reason);
      return connection;
    }
    if (connection.status().code() != absl::StatusCode::kUnavailable) return connection.status();
    // A peer whose TensorFlow answers but whose tf_rdma does not will never connect: say so now.
    absl::Status diagnosis = DiagnoseMissingPeer(peer, connection.status());
    if (diagnosis.code() == absl::StatusCode::kFailedPrecondition) return diagnosis;
    if (!diagnosis.ok() && WasConnected(peer.task)) return diagnosis;
    if (!backoff.Wait()) return diagnosis.ok() ? connection.status() : diagnosis;
  }
}

absl::StatusOr<std::shared_ptr<Connection>> Connections::Dial(const Endpoint& address) {
  absl::StatusOr<std::pair<Transport*, BackendChoice>> route = transports_.To(address.host);
  if (!route.ok()) return route.status();
  const auto& [transport, choice] = *route;
  // One attempt (the transport retries within it): a listener named by a running server is up.
  absl::StatusOr<std::shared_ptr<Connection>> connection = transport->Connect(address);
  if (!connection.ok()) {
    return absl::Status(connection.status().code(), absl::StrCat("no tf_rdma connection to ", address.ToString(),
                                                                 ": ", connection.status().message()));
  }
  LOG(INFO) << "tf_rdma: " << BackendName(choice.backend) << " to " << (*connection)->peer_name() << " at "
            << address.ToString() << " (" << choice.reason << ")";
  RecordConnection((*connection)->peer_name(), choice.backend, choice.reason);
  return connection;
}

absl::Status Connections::CheckPeerCanConnect(const std::string& peer_task) {
  // An explicit backend that cannot join the two tasks (shm with the peer on another host; verbs
  // when this task's address is on no RDMA device of this host, 127.0.0.1, so the peer's dial
  // through its RDMA device never arrives) fails the peer's connect at once, but its step may
  // have finished already: say it here too rather than wait out the timeout. Every task has the
  // same TF_RDMA_BACKEND, so the peer's choice for this host fails as this task's for the peer's.
  absl::StatusOr<Backend> requested = ParseBackend(config_.backend);  // not for auto
  if (!requested.ok()) return absl::OkStatus();
  const TransportOptions transport_options = TransportOptionsFrom(config_);
  const std::string host = addresses_.Find(local_task_).value_or(TaskAddress{}).host;
  const std::optional<TaskAddress> peer = addresses_.Find(peer_task);
  // A peer whose name this host cannot resolve may still connect: only it needs to resolve ours.
  if (peer && IsLocalHost(peer->host).ok()) {
    absl::StatusOr<BackendChoice> choice = ChooseBackend(config_.backend, peer->host, transport_options);
    if (!choice.ok()) return choice.status();
  }
  const BackendRegistration& registration = RegistrationOf(*requested);
  if (registration.reaches != nullptr && registration.viable(transport_options).ok()) {
    absl::Status reachable = registration.reaches(host);
    if (!reachable.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "task ", peer_task, " cannot connect to this task (", local_task_, ") over ",
          config_.backend, " at ", host, ", the address the cluster gives it: ", reachable.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Connection>> Connections::AwaitFrom(const std::string& peer_task) {
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  absl::Status can_connect = CheckPeerCanConnect(peer_task);
  if (!can_connect.ok()) return can_connect;
  bool identity_checked = false;
  bool diagnosed = false;
  uint64_t dial_asks_made = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    Peer& state = peers_.at(peer_task);
    if (state.connection && state.connection->health().ok()) return state.connection;
    if (state.dial_asks > dial_asks_made) {
      // A call came to wait (WithConnection's kAskPeerToDial): dialled at once, the peer learns that this
      // task waits for it, refuses the dial and dials back (OnAccepted), where it might not need
      // the connection for a while (its worker is called first). Dialled only if its tf_rdma port
      // answers (a TCP connect, quick), since a dial retries a listener that is not up until the
      // connect timeout. Where the port refuses, a peer that was connected and whose TensorFlow
      // port refuses too has died, and one whose TensorFlow port answers runs without tf_rdma:
      // either fails the wait at once. A port that does not answer (a frozen peer's full backlog, a
      // lost link) is waited for as any peer is.
      dial_asks_made = state.dial_asks;
      const std::optional<TaskAddress> address = addresses_.Find(peer_task);
      if (!address) continue;
      const bool was_connected = state.was_connected;
      lock.unlock();
      PortState rdma_port = Probe(address->host, address->rdma_port, absl::Seconds(1));
      if (rdma_port == PortState::kAnswers && was_connected) {
        // A killed task's listener closes a moment after its connections reset: asked as its
        // connection ended, it may still answer. Asked again, it tells, where asking its identity
        // would wait out a whole connect attempt on a port that refuses.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        rdma_port = Probe(address->host, address->rdma_port, absl::Seconds(1));
      }
      absl::Status diagnosis = absl::OkStatus();
      absl::StatusOr<std::string> identity = absl::UnavailableError("its tf_rdma port does not answer");
      if (rdma_port == PortState::kAnswers) identity = IdentityAt(*address);
      if (rdma_port == PortState::kRefuses) {
        diagnosis = DiagnoseMissingPeer(*address, absl::UnavailableError("its tf_rdma port refuses connections"));
      }
      lock.lock();
      if (diagnosis.code() == absl::StatusCode::kFailedPrecondition) return diagnosis;
      if (!diagnosis.ok() && peers_.at(peer_task).was_connected) return diagnosis;
      identity_checked = identity_checked || identity.ok();
      if (identity.ok() && *identity != peer_task) return addresses_.MarkRenamed(*address, *identity);
      continue;
    }
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "task ", peer_task, " did not connect to this task's tf_rdma listener within ",
          absl::FormatDuration(config_.connect_timeout),
          " (TF_RDMA_CONNECT_TIMEOUT_MS). Is it running with tf_rdma?"));
    }
    // Every accepted connection wakes every waiter: the peer is diagnosed (and its identity
    // probed again if it did not answer at first) only once a whole attempt passed without its
    // connection.
    // The wait ends at the deadline, so a timeout shorter than an attempt is kept. A peer that was
    // connected and is not back soon is diagnosed soon: its connection just ended, and a peer that
    // died is told by its port at once (a killed task's listener may still answer the first probe,
    // made as its connection reset).
    const absl::Duration attempt = state.was_connected ? kReconnectAttempt : kConnectAttempt;
    const absl::Duration wait = std::max(std::min(attempt, deadline - absl::Now()), absl::ZeroDuration());
    const bool connected = accepted_.wait_for(lock, absl::ToChronoMilliseconds(wait), [&state, dial_asks_made] {
      return (state.connection && state.connection->health().ok()) || state.dial_asks > dial_asks_made;
    });
    if (connected && state.connection && state.connection->health().ok()) return state.connection;
    if (connected) continue;  // a call came to wait too: ask the peer to dial now
    // Past the deadline only if no attempt diagnosed it yet: a timeout shorter than an attempt
    // still finds a renamed or refusing peer.
    const std::optional<TaskAddress> address = addresses_.Find(peer_task);
    if (!address || (absl::Now() > deadline && diagnosed)) continue;
    diagnosed = true;
    lock.unlock();
    absl::Status diagnosis = DiagnoseMissingPeer(*address, absl::UnavailableError("it did not connect"));
    lock.lock();
    if (diagnosis.code() == absl::StatusCode::kFailedPrecondition) return diagnosis;
    if (!diagnosis.ok() && state.was_connected) return diagnosis;
    // Its tf_rdma answers but it does not connect: it may be the server of a task named otherwise.
    if (diagnosis.ok() && !identity_checked) {
      identity_checked = true;
      lock.unlock();
      absl::StatusOr<std::string> identity = IdentityAt(*address);
      lock.lock();
      if (identity.ok() && *identity != peer_task) return addresses_.MarkRenamed(*address, *identity);
    }
  }
}

absl::StatusOr<std::string> Connections::IdentityAt(const TaskAddress& peer) {
  absl::StatusOr<std::pair<Transport*, BackendChoice>> route = transports_.To(peer.host);
  if (!route.ok()) return route.status();
  absl::StatusOr<std::shared_ptr<Connection>> probe = route->first->Connect(Endpoint{peer.host, peer.rdma_port});
  if (!probe.ok()) return probe.status();
  stats_.Peer(peer.task, [](PeerStats& s) { s.probes++; });
  const std::string identity = (*probe)->peer_name();
  (*probe)->Close(absl::CancelledError("identity probe"));
  return identity;
}

}  // namespace tf_rdma
