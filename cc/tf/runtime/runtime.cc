#include "cc/tf/runtime/runtime.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/backend_selection.h"

namespace tf_rdma {
namespace {

std::mutex instance_mu;
Runtime* instance = nullptr;  // lives until the process exits: kernels may run until then

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

}  // namespace

absl::StatusOr<std::string> TaskOfDevice(const std::string& device) {
  const size_t at = device.find("/device:");
  if (device.rfind("/job:", 0) != 0 || at == std::string::npos || device.find("/task:") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", device, "' is not a fully qualified device name"));
  }
  return device.substr(0, at);
}

absl::Status Runtime::Start(const RuntimeOptions& options) {
  std::lock_guard<std::mutex> lock(instance_mu);
  if (instance != nullptr) {
    if (instance->options_.local_task == options.local_task &&
        instance->options_.tasks.size() == options.tasks.size()) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "tf_rdma already runs in this process as task '", instance->options_.local_task,
        "'; one process belongs to one cluster, as one task"));
  }
  auto runtime = std::unique_ptr<Runtime>(new Runtime(options));
  for (const TaskAddress& task : options.tasks) runtime->peers_[task.task].address = task;
  if (!options.local_task.empty()) {
    if (!runtime->KnowsTask(options.local_task)) {
      return absl::InvalidArgumentError(absl::StrCat("task ", options.local_task, " is not in the cluster"));
    }
    absl::Status listening = runtime->Listen();
    if (!listening.ok()) return listening;
  }
  instance = runtime.release();
  return absl::OkStatus();
}

Runtime* Runtime::Get() {
  std::lock_guard<std::mutex> lock(instance_mu);
  return instance;
}

absl::StatusOr<Runtime*> Runtime::ForKernels() {
  Runtime* runtime = Get();
  if (runtime == nullptr) {
    return absl::FailedPreconditionError(
        "a tf_rdma kernel runs in a process where tf_rdma is not started; start every task of the "
        "cluster with tf_rdma.Server");
  }
  return runtime;
}

bool Runtime::KnowsTask(const std::string& task) const {
  std::lock_guard<std::mutex> lock(mu_);
  return peers_.count(task) > 0;
}

absl::StatusOr<Transport*> Runtime::TransportFor(Backend backend) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transports_.find(backend);
  if (it != transports_.end()) return it->second.get();
  TransportOptions transport_options;
  transport_options.local_name = options_.local_task.empty() ? "client" : options_.local_task;
  transport_options.cluster_key = options_.cluster_key;
  transport_options.peer_timeout = options_.config.peer_timeout;
  transport_options.connect_timeout = std::min(kAttempt, options_.config.connect_timeout);
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateTransport(backend, transport_options);
  if (!transport.ok()) return transport.status();
  Transport* raw = transport->get();
  transports_[backend] = std::move(*transport);
  pools_[backend] = std::make_shared<BufferPool>(raw, options_.slab_bytes);
  return raw;
}

absl::StatusOr<BufferPool*> Runtime::PoolFor(Backend backend) {
  absl::StatusOr<Transport*> transport = TransportFor(backend);
  if (!transport.ok()) return transport.status();
  std::lock_guard<std::mutex> lock(mu_);
  return pools_.at(backend).get();
}

absl::Status Runtime::Listen() {
  const TaskAddress self = peers_.at(options_.local_task).address;
  for (Backend backend : {Backend::kTcp, Backend::kShm, Backend::kVerbs}) {
    if (!BackendAvailable(backend).ok()) continue;
    absl::StatusOr<Transport*> transport = TransportFor(backend);
    if (!transport.ok()) return transport.status();
    absl::StatusOr<std::unique_ptr<Listener>> listener = (*transport)->Listen(
        Endpoint{"", self.rdma_port}, [this](std::shared_ptr<Connection> c) { OnAccepted(std::move(c)); });
    if (!listener.ok()) {
      return absl::Status(listener.status().code(),
                          absl::StrCat("tf_rdma cannot listen for task ", self.task, " on port ",
                                       self.rdma_port, " (", BackendName(backend), "): ",
                                       listener.status().message()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    listeners_.push_back(std::move(*listener));
  }
  LOG(INFO) << "tf_rdma: task " << self.task << " listens on port " << self.rdma_port;
  return absl::OkStatus();
}

void Runtime::OnAccepted(std::shared_ptr<Connection> connection) {
  const std::string peer = connection->peer_name();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end() || !(peer < options_.local_task)) {
    connection->Close(absl::PermissionDeniedError(absl::StrCat(
        "task ", options_.local_task, " does not accept connections from '", peer,
        "': not a task of this cluster, or not the side that connects")));
    return;
  }
  if (it->second.connection) it->second.connection->Close(absl::UnavailableError("peer reconnected"));
  it->second.connection = std::move(connection);
  stats_.Peer(peer, [&](PeerStats& s) {
    s.backend = BackendName(it->second.connection->backend());
    s.backend_reason = "chosen by the peer, which connects";
    s.connects++;
  });
  accepted_.notify_all();
}

void Runtime::WithConnection(const std::string& peer_task, ConnectionCallback done) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = peers_.find(peer_task);
  if (it == peers_.end()) {
    lock.unlock();
    done(absl::NotFoundError(absl::StrCat("task ", peer_task, " is not in tf_rdma's cluster")));
    return;
  }
  if (options_.local_task.empty()) {
    lock.unlock();
    done(absl::FailedPreconditionError(
        "this process only builds graphs for the cluster (no tf_rdma.Server runs here), so it "
        "cannot move tensors; run the graph on the cluster's tasks"));
    return;
  }
  Peer& peer = it->second;
  if (peer.connection && peer.connection->health().ok()) {
    std::shared_ptr<Connection> connection = peer.connection;
    lock.unlock();
    done(std::move(connection));
    return;
  }
  peer.waiters.push_back(std::move(done));
  if (!peer.connecting) {
    peer.connecting = true;
    std::thread([this, peer_task] { Establish(peer_task); }).detach();
  }
}

void Runtime::Establish(const std::string& peer_task) {
  TaskAddress address;
  {
    std::lock_guard<std::mutex> lock(mu_);
    address = peers_.at(peer_task).address;
  }
  absl::StatusOr<std::shared_ptr<Connection>> result =
      options_.local_task < peer_task ? ConnectTo(address) : AwaitFrom(address);
  std::vector<ConnectionCallback> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_.at(peer_task);
    peer.connecting = false;
    if (result.ok() && peer.connection != *result) {
      if (peer.connection) peer.connection->Close(absl::UnavailableError("replaced by a new connection"));
      peer.connection = *result;
    }
    waiters.swap(peer.waiters);
  }
  if (!result.ok()) {
    LOG(ERROR) << "tf_rdma: no connection to task " << peer_task << ": " << result.status();
    stats_.Peer(peer_task, [](PeerStats& s) { s.errors++; });
  }
  for (auto& waiter : waiters) waiter(result);
}

absl::StatusOr<std::shared_ptr<Connection>> Runtime::ConnectTo(const TaskAddress& peer) {
  absl::StatusOr<BackendChoice> choice = ChooseBackend(options_.config.backend, peer.host);
  if (!choice.ok()) return choice.status();
  absl::StatusOr<Transport*> transport = TransportFor(choice->backend);
  if (!transport.ok()) return transport.status();
  const absl::Time deadline = absl::Now() + options_.config.connect_timeout;
  while (true) {
    absl::StatusOr<std::shared_ptr<Connection>> connection =
        (*transport)->Connect(Endpoint{peer.host, peer.rdma_port});
    if (connection.ok()) {
      LOG(INFO) << "tf_rdma: " << BackendName(choice->backend) << " to task " << peer.task << " at "
                << peer.host << ":" << peer.rdma_port << " (" << choice->reason << ")";
      stats_.Peer(peer.task, [&](PeerStats& s) {
        s.backend = BackendName(choice->backend);
        s.backend_reason = choice->reason;
        s.connects++;
      });
      return connection;
    }
    if (connection.status().code() != absl::StatusCode::kUnavailable) return connection.status();
    // A peer whose TensorFlow answers but whose tf_rdma does not will never connect: say so now.
    absl::Status diagnosis = DiagnoseMissingPeer(peer, connection.status());
    if (diagnosis.code() == absl::StatusCode::kFailedPrecondition) return diagnosis;
    if (absl::Now() > deadline) return diagnosis.ok() ? connection.status() : diagnosis;
  }
}

absl::StatusOr<std::shared_ptr<Connection>> Runtime::AwaitFrom(const TaskAddress& peer) {
  const absl::Time deadline = absl::Now() + options_.config.connect_timeout;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    Peer& state = peers_.at(peer.task);
    if (state.connection && state.connection->health().ok()) return state.connection;
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "task ", peer.task, " did not connect to this task's tf_rdma listener within ",
          absl::FormatDuration(options_.config.connect_timeout),
          " (TF_RDMA_CONNECT_TIMEOUT_MS). Is it running with tf_rdma.Server?"));
    }
    accepted_.wait_for(lock, absl::ToChronoMilliseconds(kAttempt));
    if (state.connection && state.connection->health().ok()) return state.connection;
    lock.unlock();
    absl::Status diagnosis = DiagnoseMissingPeer(peer, absl::UnavailableError("it did not connect"));
    lock.lock();
    if (diagnosis.code() == absl::StatusCode::kFailedPrecondition) return diagnosis;
  }
}

absl::Status Runtime::DiagnoseMissingPeer(const TaskAddress& peer, const absl::Status& cause) const {
  if (Answers(peer.host, peer.rdma_port, absl::Seconds(1))) return absl::OkStatus();
  if (Answers(peer.host, peer.grpc_port, absl::Seconds(1))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", peer.task, " runs TensorFlow without tf_rdma: its TensorFlow server answers at ",
        peer.host, ":", peer.grpc_port, " but nothing listens on its tf_rdma port ", peer.rdma_port,
        ". Start every task of the cluster with tf_rdma.Server (and the same TF_RDMA_PORT_OFFSET)."));
  }
  return absl::UnavailableError(absl::StrCat("task ", peer.task, " is unreachable at ", peer.host,
                                             ":", peer.rdma_port, ": ", cause.message()));
}

}  // namespace tf_rdma
