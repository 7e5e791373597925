#include "cc/tf/runtime/runtime.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <system_error>
#include <thread>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/runtime/task_names.h"
#include "cc/transport/addresses.h"
#include "cc/transport/backend_registry.h"
#include "cc/transport/backend_selection.h"
#include "cc/transport/connect_retry.h"
#include "cc/transport/crypto.h"

namespace tf_rdma {
namespace {

std::mutex registry_mu;
// Never destroyed: transfers may complete on transport threads until the process exits.
auto* registry = new std::vector<std::shared_ptr<Runtime>>();

constexpr size_t kMaxLearnedTransfers = 1 << 16;
constexpr size_t kMaxPeers = 1 << 14;
// Messages given up per peer that its next connection still answers (Runtime::GiveUp): a few
// steps' worth of a task's transfers to one peer, and a few KiB per peer at most.
constexpr size_t kGivenUpTagsPerPeer = 512;

constexpr char kChosenByPeer[] = "chosen by the peer, which connects";

// One connection attempt lasts this long before the runtime checks why the peer is not there.
constexpr absl::Duration kAttempt = absl::Seconds(4);

// Whether something accepts TCP connections at host:port, within `limit`.
bool Answers(const std::string& host, uint16_t port, absl::Duration limit) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &resolved) != 0) return false;
  bool answered = false;
  for (addrinfo* a = resolved; a != nullptr && !answered; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      answered = true;
    } else if (errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      int error = 0;
      socklen_t length = sizeof(error);
      answered = poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(limit))) == 1 &&
                 getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
    }
    close(fd);
  }
  freeaddrinfo(resolved);
  return answered;
}

// The server at `peer`'s address is tf_rdma's server of another task: the cluster the caller got the
// address from names the tasks differently from how their servers were started.
absl::Status RenamedPeer(const TaskAddress& peer, const std::string& identity) {
  return absl::FailedPreconditionError(absl::StrCat(
      "task ", peer.task, " at ", peer.host, ":", peer.grpc_port, " is served by the tf_rdma server of task ",
      identity, ": a session or eager context renamed it (ClusterSpec propagation), so tensors with it go "
      "over gRPC, counted in tf_rdma.stats()['fallback']. To carry them over tf_rdma, start each server "
      "under the job name and index the session's cluster gives it"));
}

}  // namespace

Runtime::Runtime(RuntimeOptions options) : options_(std::move(options)) {
  for (const TaskAddress& task : options_.tasks) {
    Peer& peer = peers_[task.task];
    peer.address = task;
    peer.address_known = true;
  }
}

Runtime::~Runtime() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_.notify_all();
  if (idle_region_releaser_.joinable()) idle_region_releaser_.join();
}

absl::StatusOr<std::shared_ptr<Runtime>> Runtime::Start(const RuntimeOptions& options) {
  // Tensor tags are SHA-256 digests (tensor_message.cc); the handshake needs libcrypto too.
  absl::Status crypto = LoadCrypto();
  if (!crypto.ok()) return crypto;
  std::shared_ptr<Runtime> runtime(new Runtime(options));
  auto self = runtime->peers_.find(options.local_task);
  if (self == runtime->peers_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("task ", options.local_task, " is not in its own cluster"));
  }
  absl::Status listening = runtime->Listen();
  if (!listening.ok()) return listening;
  if (options.config.receive_pool_idle > absl::ZeroDuration()) {
    Runtime* raw = runtime.get();
    runtime->idle_region_releaser_ = std::thread([raw] { raw->ReleaseIdleRegions(); });
  }
  std::lock_guard<std::mutex> lock(registry_mu);
  registry->push_back(runtime);
  return runtime;
}

std::vector<std::shared_ptr<Runtime>> Runtime::Running() {
  std::lock_guard<std::mutex> lock(registry_mu);
  return *registry;
}

void Runtime::UpdateTasks(const std::vector<TaskAddress>& tasks) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const TaskAddress& task : tasks) {
    if (task.task == options_.local_task) continue;
    Peer& peer = peers_[task.task];
    const bool moved = peer.address_known &&
                       (peer.address.host != task.host || peer.address.rdma_port != task.rdma_port);
    peer.address = task;
    peer.address_known = true;
    if (moved && peer.connection) {
      RetireLocked(peer.connection, absl::UnavailableError(absl::StrCat("task ", task.task, " moved to ", task.host)));
      peer.connection.reset();
    }
  }
}

uint64_t Runtime::ExpectedBytes(const std::string& transfer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = learned_bytes_.find(transfer);
  return it == learned_bytes_.end() ? 0 : it->second;
}

void Runtime::Learn(const std::string& transfer, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  // Forgetting costs one regrant per transfer; remembering everything could grow without bound.
  if (learned_bytes_.size() >= kMaxLearnedTransfers && !learned_bytes_.count(transfer)) learned_bytes_.clear();
  learned_bytes_[transfer] = bytes;
}

absl::StatusOr<Transport*> Runtime::TransportFor(Backend backend) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transports_.find(backend);
  if (it != transports_.end()) return it->second.get();
  TransportOptions transport_options = TransportOptionsFrom(options_.config);
  transport_options.local_name = options_.local_task;
  absl::StatusOr<std::string> cluster_key = ClusterKey(options_.config.secret);
  if (!cluster_key.ok()) return cluster_key.status();
  transport_options.cluster_key = *std::move(cluster_key);
  transport_options.connect_timeout = std::min(kAttempt, options_.config.connect_timeout);
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateTransport(backend, transport_options);
  if (!transport.ok()) return transport.status();
  Transport* raw = transport->get();
  transports_[backend] = std::move(*transport);
  return raw;
}

absl::StatusOr<std::shared_ptr<BufferPool>> Runtime::PoolFor(const std::shared_ptr<Connection>& connection) {
  absl::StatusOr<Transport*> transport = TransportFor(connection->backend());
  if (!transport.ok()) return transport.status();
  std::lock_guard<std::mutex> lock(mu_);
  auto found = pools_.find(connection.get());
  if (found != pools_.end() && found->second.connection.lock() == connection) return found->second.pool;
  // A connection's first receive. Pools of connections that ended without being replaced (their
  // peer died and never came back) go now, not at the process's end.
  for (auto it = pools_.begin(); it != pools_.end();) {
    std::shared_ptr<Connection> owner = it->second.connection.lock();
    it = owner && owner->health().ok() ? std::next(it) : pools_.erase(it);
  }
  auto pool = std::make_shared<BufferPool>(*transport, options_.min_slab_bytes, options_.max_slab_bytes);
  pools_[connection.get()] = ConnectionPool{connection, connection->backend(), pool};
  return pool;
}

void Runtime::RetireLocked(const std::shared_ptr<Connection>& connection, const absl::Status& reason) {
  connection->Close(reason);
  auto it = pools_.find(connection.get());
  if (it != pools_.end() && it->second.connection.lock() == connection) pools_.erase(it);
}

void Runtime::ReleaseIdleRegions() {
  const absl::Duration idle = options_.config.receive_pool_idle;
  // A region goes between `idle` and 1.25 `idle` after its last buffer came back.
  const auto period = absl::ToChronoMilliseconds(std::max(idle / 4, absl::Milliseconds(1)));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_.wait_for(lock, period, [this] { return stopping_; })) {
    std::vector<std::shared_ptr<BufferPool>> pools;
    for (const auto& [connection, entry] : pools_) pools.push_back(entry.pool);
    lock.unlock();
    const absl::Time now = absl::Now();
    for (const std::shared_ptr<BufferPool>& pool : pools) pool->ReleaseIdle(now, idle);
    pools.clear();  // a retired pool's last owner may be this list: it goes without mu_ held
    lock.lock();
  }
}

std::map<Backend, BufferPool::Usage> Runtime::PoolUsage() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<Backend, BufferPool::Usage> usage;
  for (const auto& [connection, entry] : pools_) {
    const BufferPool::Usage pool = entry.pool->usage();
    BufferPool::Usage& total = usage[entry.backend];
    total.region_bytes += pool.region_bytes;
    total.buffers_in_use += pool.buffers_in_use;
    total.bytes_in_use += pool.bytes_in_use;
  }
  return usage;
}

absl::Status Runtime::Listen() {
  const TaskAddress self = peers_.at(options_.local_task).address;
  // Peers know one port per task: with port 0, the first listener's free port is every backend's.
  uint16_t port = self.rdma_port;
  const TransportOptions transport_options = TransportOptionsFrom(options_.config);
  for (const BackendRegistration& registration : RegisteredBackends()) {
    const Backend backend = registration.backend;
    if (!registration.viable(transport_options).ok()) continue;
    absl::StatusOr<Transport*> transport = TransportFor(backend);
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
  port_ = port;
  // Formatted by StrCat: absl's LogMessage takes integers through templates that some TensorFlow
  // releases (built by clang 18) export under names g++ does not use (tools/tensorflow_versions.py).
  LOG(INFO) << absl::StrCat("tf_rdma: task ", self.task, " listens on port ", port);
  return absl::OkStatus();
}

void Runtime::RecordConnection(const std::string& peer, Backend backend, const std::string& reason) {
  stats_.Peer(peer, [&](PeerStats& s) {
    s.backend = BackendName(backend);
    s.backend_reason = reason;
    s.connects++;
  });
}

absl::Status Runtime::AdmitLocked(const std::string& peer) {
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
    LOG(WARNING) << "tf_rdma: task " << options_.local_task << " told a dial claiming to be task " << peer
                 << " to wait: that task's connection is alive. An impersonator, or that task connecting "
                 << "again before its old connection was seen to end (admitted once it has)";
  }
  return absl::UnavailableError(absl::StrCat("its connection with task ", peer,
                                             " is alive still; a new one is admitted once it ends"));
}

absl::Status Runtime::Admit(const std::string& peer) {
  if (options_.serve_any_peer) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return AdmitLocked(peer);
}

void Runtime::OnAccepted(std::shared_ptr<Connection> connection) {
  const std::string peer = connection->peer_name();
  if (options_.serve_any_peer) {
    RecordConnection(peer, connection->backend(), kChosenByPeer);
    options_.serve_any_peer(std::move(connection));
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // A task this server has not heard of yet may be a client whose cluster reaches us with its first
  // request (an eager context, a coordinator); it proved the cluster key, so it may connect.
  // Names a peer claims become records here: a key holder must not grow them without bound.
  // Judged after the handshake, not in it (Admit): a peer that does not connect to this task and
  // dials anyway wants the handshake itself, which proves the listener's name and key to it
  // (`tf_rdma doctor`, named as no task; IdentityAt, asking who serves an address).
  const bool new_name_past_limit = peers_.count(peer) == 0 && peers_.size() >= kMaxPeers;
  const bool task_name = TaskOfDevice(peer + "/device:CPU:0").ok();
  if (!task_name || !(peer < options_.local_task) || new_name_past_limit) {
    connection->Close(absl::PermissionDeniedError(absl::StrCat(
        "task ", options_.local_task, " does not accept connections from '", peer,
        "': not a task name, not the side that connects, or past ", kMaxPeers, " peer tasks")));
    if (task_name && options_.local_task < peer) DialBackLocked(peer);
    return;
  }
  // Admitted in its handshake, but judged again under the lock that adopts it: of two connections
  // claiming one name admitted at once (an impersonator's beside the task's), only the first is
  // adopted; the other is closed, and its peer's next transfer connects again.
  absl::Status admitted = AdmitLocked(peer);
  if (!admitted.ok()) {
    LOG(WARNING) << "tf_rdma: task " << options_.local_task << " closed a connection claiming to be task " << peer
                 << ", admitted alongside another: an impersonator, or two dials at once";
    connection->Close(absl::Status(admitted.code(), absl::StrCat("task ", options_.local_task,
                                                                 " does not accept it: ", admitted.message())));
    return;
  }
  Peer& state = peers_[peer];
  if (state.connection) RetireLocked(state.connection, absl::UnavailableError("peer reconnected"));
  AdoptLocked(peer, state, std::move(connection));
  state.was_connected = true;
  RecordConnection(peer, state.connection->backend(), kChosenByPeer);
  accepted_.notify_all();
}

void Runtime::DialBackLocked(const std::string& peer_task) {
  // A task that waits for this one's dial asks who serves this address after an attempt's wait
  // (AwaitFrom's IdentityAt). Nothing here may need it any more: this task gave up its transfer
  // (the resend's dial found the peer frozen past TF_RDMA_CONNECT_TIMEOUT_MS), so only its
  // receive waits, and it would wait out its own connect timeout. Dialled, it learns why at once
  // (WITHDRAWN, from the tags given up).
  auto known = peers_.find(peer_task);
  if (known == peers_.end() || !known->second.address_known || known->second.connecting) return;
  Peer& peer = known->second;
  if (peer.connection && peer.connection->health().ok()) return;
  const absl::Status started = StartEstablishingLocked(peer_task, peer);
  if (!started.ok()) LOG(WARNING) << "tf_rdma: " << started;
}

absl::Status Runtime::StartEstablishingLocked(const std::string& peer_task, Peer& peer) {
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

void Runtime::WithConnection(const std::string& peer_task, ConnectionCallback done) {
  std::unique_lock<std::mutex> lock(mu_);
  Peer& peer = peers_[peer_task];
  if (!peer.served_by.empty()) {
    const absl::Status renamed = RenamedPeer(peer.address, peer.served_by);
    lock.unlock();
    done(renamed);
    return;
  }
  if (peer.connection && peer.connection->health().ok()) {
    std::shared_ptr<Connection> connection = peer.connection;
    lock.unlock();
    done(std::move(connection));
    return;
  }
  peer.waiters.push_back(std::move(done));
  if (peer.connecting) return;
  const absl::Status started = StartEstablishingLocked(peer_task, peer);
  if (started.ok()) return;
  std::vector<ConnectionCallback> waiters;
  waiters.swap(peer.waiters);
  lock.unlock();
  for (auto& waiter : waiters) waiter(started);
}

void Runtime::GiveUp(const std::string& peer_task, const std::vector<Tag>& tags, const absl::Status& why) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(given_up_mu_);
    GivenUp& given_up = given_up_[peer_task];
    for (const Tag& tag : tags) {
      const bool known = std::any_of(given_up.tags.begin(), given_up.tags.end(),
                                     [&tag](const auto& entry) { return entry.first == tag; });
      if (known) continue;
      given_up.tags.emplace_back(tag, why);
      if (given_up.tags.size() > kGivenUpTagsPerPeer) given_up.tags.pop_front();
    }
    connection = given_up.connection.lock();
  }
  // Unlocked: writes waiting under the tags complete here, and their callbacks may ask for the
  // connection again. A connection adopted after the tags were listed took them from the list.
  if (connection == nullptr) return;
  for (const Tag& tag : tags) connection->DropWrites(tag, why);
}

void Runtime::AdoptLocked(const std::string& peer_task, Peer& peer, std::shared_ptr<Connection> connection) {
  std::deque<std::pair<Tag, absl::Status>> given_up;
  {
    std::lock_guard<std::mutex> lock(given_up_mu_);
    auto it = given_up_.find(peer_task);
    if (it != given_up_.end()) {
      given_up = it->second.tags;
      it->second.connection = connection;
    } else {
      given_up_[peer_task].connection = connection;
    }
  }
  for (const auto& [tag, why] : given_up) connection->DropWrites(tag, why);
  peer.connection = std::move(connection);
}

void Runtime::Establish(const std::string& peer_task) {
  TaskAddress address;
  bool address_known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    address = peers_.at(peer_task).address;
    address_known = peers_.at(peer_task).address_known;
  }
  absl::StatusOr<std::shared_ptr<Connection>> result;
  if (peer_task < options_.local_task) {
    result = AwaitFrom(peer_task);
  } else if (address_known) {
    result = ConnectTo(address);
  } else {
    result = absl::NotFoundError(absl::StrCat(
        "task ", peer_task, " is in no cluster definition this server (", options_.local_task,
        ") has seen, so its tf_rdma address is unknown"));
  }
  std::vector<ConnectionCallback> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_.at(peer_task);
    peer.connecting = false;
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

absl::StatusOr<std::pair<Transport*, BackendChoice>> Runtime::TransportTo(const TaskAddress& peer) {
  absl::StatusOr<BackendChoice> choice =
      ChooseBackend(options_.config.backend, peer.host, TransportOptionsFrom(options_.config));
  if (!choice.ok()) return choice.status();
  absl::StatusOr<Transport*> transport = TransportFor(choice->backend);
  if (!transport.ok()) return transport.status();
  return std::make_pair(*transport, *choice);
}

absl::Status Runtime::MarkRenamedLocked(const TaskAddress& peer, const std::string& identity) {
  peers_[peer.task].served_by = identity;
  absl::Status renamed = RenamedPeer(peer, identity);
  LOG(WARNING) << "tf_rdma: " << renamed.message();
  return renamed;
}

absl::StatusOr<std::shared_ptr<Connection>> Runtime::ConnectTo(const TaskAddress& peer) {
  absl::StatusOr<std::pair<Transport*, BackendChoice>> route = TransportTo(peer);
  if (!route.ok()) return route.status();
  const auto& [transport, choice] = *route;
  const absl::Time deadline = absl::Now() + options_.config.connect_timeout;
  // The transport retries a peer that is not listening yet; one that answers and then fails at
  // once (it hangs up, or is still starting) is retried here, and must not be in a tight loop.
  ConnectBackoff backoff(deadline);
  while (true) {
    absl::StatusOr<std::shared_ptr<Connection>> connection =
        transport->Connect(Endpoint{peer.host, peer.rdma_port});
    if (connection.ok() && (*connection)->peer_name() != peer.task) {
      const std::string identity = (*connection)->peer_name();
      (*connection)->Close(absl::FailedPreconditionError("not the task dialled"));
      std::lock_guard<std::mutex> lock(mu_);
      return MarkRenamedLocked(peer, identity);
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

absl::StatusOr<std::shared_ptr<Connection>> Runtime::Dial(const Endpoint& address) {
  TaskAddress peer;
  peer.host = address.host;
  peer.rdma_port = address.port;
  absl::StatusOr<std::pair<Transport*, BackendChoice>> route = TransportTo(peer);
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

absl::StatusOr<std::shared_ptr<Connection>> Runtime::AwaitFrom(const std::string& peer_task) {
  const absl::Time deadline = absl::Now() + options_.config.connect_timeout;
  bool identity_checked = false;
  bool diagnosed = false;
  // An explicit backend that cannot join the two tasks (shm with the peer on another host; verbs
  // when this task's address is on no RDMA device of this host, 127.0.0.1, so the peer's dial
  // through its RDMA device never arrives) fails the peer's connect at once, but its step may
  // have finished already: say it here too rather than wait out the timeout. Every task has the
  // same TF_RDMA_BACKEND, so the peer's choice for this host fails as this task's for the peer's.
  absl::StatusOr<Backend> requested = ParseBackend(options_.config.backend);  // not for auto
  if (requested.ok()) {
    const TransportOptions transport_options = TransportOptionsFrom(options_.config);
    std::string host, peer_host;
    bool peer_address_known;
    {
      std::lock_guard<std::mutex> lock(mu_);
      host = peers_.at(options_.local_task).address.host;
      peer_host = peers_.at(peer_task).address.host;
      peer_address_known = peers_.at(peer_task).address_known;
    }
    // A peer whose name this host cannot resolve may still connect: only it needs to resolve ours.
    if (peer_address_known && IsLocalHost(peer_host).ok()) {
      absl::StatusOr<BackendChoice> choice = ChooseBackend(options_.config.backend, peer_host, transport_options);
      if (!choice.ok()) return choice.status();
    }
    const BackendRegistration& registration = RegistrationOf(*requested);
    if (registration.reaches != nullptr && registration.viable(transport_options).ok()) {
      absl::Status reachable = registration.reaches(host);
      if (!reachable.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "task ", peer_task, " cannot connect to this task (", options_.local_task, ") over ",
            options_.config.backend, " at ", host, ", the address the cluster gives it: ",
            reachable.message()));
      }
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    Peer& state = peers_.at(peer_task);
    if (state.connection && state.connection->health().ok()) return state.connection;
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "task ", peer_task, " did not connect to this task's tf_rdma listener within ",
          absl::FormatDuration(options_.config.connect_timeout),
          " (TF_RDMA_CONNECT_TIMEOUT_MS). Is it running with tf_rdma?"));
    }
    // Every accepted connection wakes every waiter: the peer is diagnosed (and its identity
    // probed, which it refuses and logs) only once a whole attempt passed without its connection.
    // The wait ends at the deadline, so a timeout shorter than an attempt is kept.
    const absl::Duration wait = std::max(std::min(kAttempt, deadline - absl::Now()), absl::ZeroDuration());
    const bool connected = accepted_.wait_for(lock, absl::ToChronoMilliseconds(wait), [&state] {
      return state.connection && state.connection->health().ok();
    });
    if (connected) return state.connection;
    // Past the deadline only if no attempt diagnosed it yet: a timeout shorter than an attempt
    // still finds a renamed or refusing peer.
    if (!state.address_known || (absl::Now() > deadline && diagnosed)) continue;
    diagnosed = true;
    const TaskAddress address = state.address;
    lock.unlock();
    absl::Status diagnosis = DiagnoseMissingPeer(address, absl::UnavailableError("it did not connect"));
    lock.lock();
    if (diagnosis.code() == absl::StatusCode::kFailedPrecondition) return diagnosis;
    if (!diagnosis.ok() && state.was_connected) return diagnosis;
    // Its tf_rdma answers but it does not connect: it may be the server of a task named otherwise.
    if (diagnosis.ok() && !identity_checked) {
      identity_checked = true;
      lock.unlock();
      absl::StatusOr<std::string> identity = IdentityAt(address);
      lock.lock();
      if (identity.ok() && *identity != peer_task) return MarkRenamedLocked(address, *identity);
    }
  }
}

absl::StatusOr<std::string> Runtime::IdentityAt(const TaskAddress& peer) {
  absl::StatusOr<std::pair<Transport*, BackendChoice>> route = TransportTo(peer);
  if (!route.ok()) return route.status();
  absl::StatusOr<std::shared_ptr<Connection>> probe = route->first->Connect(Endpoint{peer.host, peer.rdma_port});
  if (!probe.ok()) return probe.status();
  const std::string identity = (*probe)->peer_name();
  (*probe)->Close(absl::CancelledError("identity probe"));
  return identity;
}

bool Runtime::Renamed(const std::string& peer_task) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer_task);
  return it != peers_.end() && !it->second.served_by.empty();
}

bool Runtime::WasConnected(const std::string& peer_task) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer_task);
  return it != peers_.end() && it->second.was_connected;
}

absl::Status Runtime::DiagnoseMissingPeer(const TaskAddress& peer, const absl::Status& cause) const {
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

}  // namespace tf_rdma
