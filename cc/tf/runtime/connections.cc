#include "cc/tf/runtime/connections.h"

#include <system_error>
#include <thread>
#include <utility>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/runtime/task_names.h"
#include "cc/transport/backend_registry.h"

namespace tf_rdma {
namespace {

// Names a peer claims become records (Connections::OnAccepted): at most this many.
constexpr size_t kMaxPeers = 1 << 14;

constexpr char kChosenByPeer[] = "chosen by the peer, which connects";

}  // namespace

Connections::Connections(const Config& config, AcceptCallback serve_any_peer, TaskAddresses& addresses,
                         Transports& transports, ReceivePools& pools, Stats& stats)
    : local_task_(addresses.local_task()), config_(config), serve_any_peer_(std::move(serve_any_peer)),
      addresses_(addresses), transports_(transports), pools_(pools), stats_(stats) {}

absl::StatusOr<uint16_t> Connections::Listen(const TaskAddress& self) {
  // Peers know one port per task: with port 0, the first listener's free port is every backend's.
  uint16_t port = self.rdma_port;
  const TransportOptions transport_options = TransportOptionsFrom(config_);
  for (const BackendRegistration& registration : RegisteredBackends()) {
    const Backend backend = registration.backend;
    if (!registration.viable(transport_options).ok()) continue;
    absl::StatusOr<Transport*> transport = transports_.For(backend);
    if (!transport.ok()) return transport.status();
    absl::StatusOr<std::unique_ptr<Listener>> listener = (*transport)->Listen(
        Endpoint{"", port}, [this](std::shared_ptr<Connection> c) { OnAccepted(std::move(c)); },
        [this](const std::string& peer) { return Admit(peer); });
    if (!listener.ok()) {
      return absl::Status(listener.status().code(),
                          absl::StrCat("tf_rdma cannot listen for task ", self.task, " on port ",
                                       port, " (", BackendName(backend), "): ",
                                       listener.status().message()));
    }
    if (port == 0) port = (*listener)->endpoint().port;
    std::lock_guard<std::mutex> lock(mu_);
    listeners_.push_back(std::move(*listener));
  }
  // Formatted by StrCat: absl's LogMessage takes integers through templates that some TensorFlow
  // releases (built by clang 18) export under names g++ does not use (tools/tensorflow_versions.py).
  LOG(INFO) << absl::StrCat("tf_rdma: task ", self.task, " listens on port ", port);
  return port;
}

void Connections::RecordConnection(const std::string& peer, Backend backend, const std::string& reason) {
  stats_.Peer(peer, [&](PeerStats& s) {
    s.backend = BackendName(backend);
    s.backend_reason = reason;
    s.connects++;
  });
}

absl::Status Connections::AdmitLocked(const std::string& peer) {
  // Any key holder can claim any task's name: a live connection is replaced only once it ended (a
  // restarted task's old connection ends when its process does; a task frozen past the peer
  // timeout reads the close of its old one soon after it runs again). Until then the peer is told
  // "not now" in its handshake, and its connect tries again until TF_RDMA_CONNECT_TIMEOUT_MS.
  auto known = peers_.find(peer);
  if (known == peers_.end() || !known->second.connection || !known->second.connection->health().ok()) {
    return absl::OkStatus();
  }
  Peer& state = known->second;
  // Once per live connection, not once per retry of the dial.
  if (state.wait_logged_for != state.connection.get()) {
    state.wait_logged_for = state.connection.get();
    LOG(WARNING) << "tf_rdma: task " << local_task_ << " told a dial claiming to be task " << peer
                 << " to wait: that task's connection is alive. An impersonator, or that task connecting "
                 << "again before its old connection was seen to end (admitted once it has)";
  }
  return absl::UnavailableError(absl::StrCat("its connection with task ", peer,
                                             " is alive still; a new one is admitted once it ends"));
}

absl::Status Connections::Admit(const std::string& peer) {
  if (serve_any_peer_) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return AdmitLocked(peer);
}

void Connections::OnAccepted(std::shared_ptr<Connection> connection) {
  const std::string peer = connection->peer_name();
  if (serve_any_peer_) {
    RecordConnection(peer, connection->backend(), kChosenByPeer);
    serve_any_peer_(std::move(connection));
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  // A task this server has not heard of yet may be a client whose cluster reaches us with its first
  // request (an eager context, a coordinator); it proved the cluster key, so it may connect.
  // Names a peer claims become records here: a key holder must not grow them without bound.
  // Judged after the handshake, not in it (Admit): a peer that does not connect to this task and
  // dials anyway wants the handshake itself, which proves the listener's name and key to it
  // (`tf_rdma doctor`, named as no task; IdentityAt, asking who serves an address).
  const bool new_name_past_limit =
      peers_.count(peer) == 0 && !addresses_.Find(peer) && peers_.size() >= kMaxPeers;
  const bool task_name = TaskOfDevice(peer + "/device:CPU:0").ok();
  if (task_name && !new_name_past_limit && local_task_ < peer && addresses_.Find(peer)) {
    // A task of the cluster waiting for this one to dial (AwaitFrom): no error, this task dials it.
    connection->Close(absl::CancelledError(absl::StrCat("task ", local_task_, " dials task ", peer, " back")));
    stats_.Peer(peer, [](PeerStats& s) { s.probes++; });
    DialBackLocked(peer);
    return;
  }
  if (!task_name || !(peer < local_task_) || new_name_past_limit) {
    connection->Close(absl::PermissionDeniedError(absl::StrCat(
        "task ", local_task_, " does not accept connections from '", peer,
        "': not a task name, not the side that connects, or past ", kMaxPeers, " peer tasks")));
    return;
  }
  // Admitted in its handshake, but judged again under the lock that adopts it: of two connections
  // claiming one name admitted at once (an impersonator's beside the task's), only the first is
  // adopted; the other is closed, and its peer's next transfer connects again.
  absl::Status admitted = AdmitLocked(peer);
  if (!admitted.ok()) {
    LOG(WARNING) << "tf_rdma: task " << local_task_ << " closed a connection claiming to be task " << peer
                 << ", admitted alongside another: an impersonator, or two dials at once";
    connection->Close(absl::Status(admitted.code(), absl::StrCat("task ", local_task_,
                                                                 " does not accept it: ", admitted.message())));
    return;
  }
  Peer& state = peers_[peer];
  if (state.connection) RetireLocked(state.connection, absl::UnavailableError("peer reconnected"));
  AdoptLocked(peer, state, std::move(connection));
  state.was_connected = true;
  RecordConnection(peer, state.connection->backend(), kChosenByPeer);
  accepted_.notify_all();
  // Waiters have their connection now, not when Establish's AwaitFrom returns: it may be asking
  // the peer to dial (IdentityAt), which waits out the peer's handshake or its "not now".
  std::vector<ConnectionCallback> waiters;
  waiters.swap(state.waiters);
  std::shared_ptr<Connection> adopted = state.connection;
  lock.unlock();
  for (auto& waiter : waiters) waiter(adopted);
}

void Connections::DialBackLocked(const std::string& peer_task) {
  // A task that waits for this one's dial asks who serves this address after an attempt's wait
  // (AwaitFrom's IdentityAt). Nothing here may need it any more: this task gave up its transfer
  // (the resend's dial found the peer frozen past TF_RDMA_CONNECT_TIMEOUT_MS), so only its
  // receive waits, and it would wait out its own connect timeout. Dialled, it learns why at once
  // (WITHDRAWN, from the tags withdrawn).
  // Any task of a cluster this server has seen, whether or not it ever exchanged with it (this
  // process may have run again since): a name no cluster gives makes no entry.
  if (!addresses_.Find(peer_task)) return;
  Peer& peer = peers_[peer_task];
  if (peer.connecting || (peer.connection && peer.connection->health().ok())) return;
  const absl::Status started = StartEstablishingLocked(peer_task, peer);
  if (!started.ok()) LOG(WARNING) << "tf_rdma: " << started;
}

absl::Status Connections::StartEstablishingLocked(const std::string& peer_task, Peer& peer) {
  peer.connecting = true;
  try {
    std::thread([this, peer_task] { Establish(peer_task); }).detach();
    return absl::OkStatus();
  } catch (const std::system_error& error) {  // the process's thread limit: an error, not a crash
    peer.connecting = false;
    return absl::ResourceExhaustedError(
        absl::StrCat("could not start a thread to connect with task ", peer_task, ": ", error.what()));
  }
}

void Connections::WithConnection(const std::string& peer_task, ConnectionCallback done, Waiting waiting) {
  const absl::Status renamed = addresses_.RenamedError(peer_task);
  if (!renamed.ok()) return done(renamed);
  std::unique_lock<std::mutex> lock(mu_);
  Peer& peer = peers_[peer_task];
  if (peer.connection && peer.connection->health().ok()) {
    std::shared_ptr<Connection> connection = peer.connection;
    lock.unlock();
    done(std::move(connection));
    return;
  }
  peer.waiters.push_back(std::move(done));
  // A peer whose connection ended is asked at once too: its port tells whether it died (the
  // wait fails now, naming it) or lives (it dials back now), rather than after a whole attempt.
  if (waiting == Waiting::kAskPeerToDial || peer.was_connected) {
    ++peer.dial_asks;
    accepted_.notify_all();  // an AwaitFrom waiting already asks now
  }
  if (peer.connecting) return;
  const absl::Status started = StartEstablishingLocked(peer_task, peer);
  if (started.ok()) return;
  std::vector<ConnectionCallback> waiters;
  waiters.swap(peer.waiters);
  lock.unlock();
  for (auto& waiter : waiters) waiter(started);
}

void Connections::Withdraw(const std::string& peer_task, const std::vector<Tag>& tags, const absl::Status& why) {
  withdrawn_.Withdraw(peer_task, tags, why);
}

void Connections::AdoptLocked(const std::string& peer_task, Peer& peer, std::shared_ptr<Connection> connection) {
  withdrawn_.Adopt(peer_task, connection);
  peer.dial_asks = 0;
  for (const ConnectionObserver& observer : observers_) observer(connection);
  peer.connection = std::move(connection);
}

void Connections::Observe(ConnectionObserver observer) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [task, peer] : peers_) {
    if (peer.connection) observer(peer.connection);
  }
  observers_.push_back(std::move(observer));
}

void Connections::Retire(const std::string& peer_task, const absl::Status& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer_task);
  if (it == peers_.end() || !it->second.connection) return;
  RetireLocked(it->second.connection, reason);
  it->second.connection.reset();
}

void Connections::RetireLocked(const std::shared_ptr<Connection>& connection, const absl::Status& reason) {
  connection->Close(reason);
  pools_.Retire(connection);
}

bool Connections::WasConnected(const std::string& peer_task) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer_task);
  return it != peers_.end() && it->second.was_connected;
}

}  // namespace tf_rdma
