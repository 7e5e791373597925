#include "cc/transport/verbs/verbs_transport.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/addresses.h"
#include "cc/transport/connect_retry.h"
#include "cc/transport/handshake_threads.h"
#include "cc/transport/io_loops.h"
#include "cc/transport/unlogged_count.h"
#include "cc/transport/verbs/rdma_libraries.h"
#include "cc/transport/verbs/verbs_connection.h"
#include "cc/transport/verbs/verbs_device.h"

namespace tf_rdma {
namespace {

using verbs::DeviceContext;
using verbs::VerbsConnection;

// rdma_cm ids and event channels not yet owned by a connection.
struct CmId {
  rdma_event_channel* channel = nullptr;
  rdma_cm_id* id = nullptr;
  ~CmId() {
    if (id != nullptr) rdma_destroy_id(id);
    if (channel != nullptr) rdma_destroy_event_channel(channel);
  }
  void Release() { id = nullptr, channel = nullptr; }
};

absl::Status CmError(const char* what, const std::string& context) {
  return absl::UnavailableError(absl::StrCat(what, " ", context, ": ", std::strerror(errno)));
}

absl::StatusOr<rdma_event_channel*> NewEventChannel() {
  rdma_event_channel* channel = rdma_create_event_channel();
  if (channel == nullptr) {
    return absl::UnavailableError(absl::StrCat("rdma_create_event_channel: ", std::strerror(errno),
                                               " (is the rdma_ucm kernel module loaded?)"));
  }
  fcntl(channel->fd, F_SETFL, fcntl(channel->fd, F_GETFL) | O_NONBLOCK);
  return channel;
}

struct CmEvent {
  rdma_cm_event_type type;
  int status;
};

// `step` names what is awaited, for the error ("ADDR_RESOLVED from 10.0.0.2:5000").
absl::StatusOr<CmEvent> WaitCmEvent(rdma_event_channel* channel, absl::Time deadline,
                                    const std::string& step) {
  while (true) {
    rdma_cm_event* event = nullptr;
    if (rdma_get_cm_event(channel, &event) == 0) {
      CmEvent result{event->event, event->status};
      rdma_ack_cm_event(event);
      return result;
    }
    if (errno != EAGAIN && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("rdma_get_cm_event: ", std::strerror(errno)));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rdma_cm: no ", step, " within the connect timeout (TF_RDMA_CONNECT_TIMEOUT_MS)"));
    }
    pollfd p{channel->fd, POLLIN, 0};
    poll(&p, 1, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000)));
  }
}

// rdma_cm gave no answer before the connect deadline: the peer is unavailable, which Connect
// reports with the timeout to raise, like a peer that kept refusing.
absl::Status NoAnswer(absl::Status status, bool* retry) {
  *retry = absl::IsDeadlineExceeded(status);
  return status;
}

absl::StatusOr<sockaddr_storage> ResolveIp(const Endpoint& endpoint, bool passive) {
  absl::StatusOr<AddressList> resolved = ResolveEndpoint(endpoint, passive);
  if (!resolved.ok()) return resolved.status();
  sockaddr_storage address{};
  std::memcpy(&address, (*resolved)->ai_addr, (*resolved)->ai_addrlen);
  return address;
}

// verbs::CheckRdmaRoute for the endpoint's address; OK if it does not resolve (the connect says why).
absl::Status RouteTo(const Endpoint& endpoint, const std::string& peer) {
  absl::StatusOr<sockaddr_storage> destination = ResolveIp(endpoint, false);
  if (!destination.ok()) return absl::OkStatus();
  return verbs::CheckRdmaRoute(reinterpret_cast<const sockaddr*>(&*destination), sizeof(*destination), peer);
}

rdma_conn_param ConnectionParameters(uint32_t qp_num) {
  rdma_conn_param param{};
  param.responder_resources = 1;
  param.initiator_depth = 1;
  param.retry_count = 7;      // ~7 x the ACK timeout before a silent peer fails the QP
  param.rnr_retry_count = 7;  // receive buffers are reposted at once; "7" waits for them
  param.qp_num = qp_num;
  return param;
}

class VerbsTransport;

// Accepts on its own thread; each client is accepted and handshaken on a thread of its own. Joins
// them all when destroyed.
class VerbsListener : public Listener {
 public:
  VerbsListener(VerbsTransport* transport, rdma_event_channel* channel, rdma_cm_id* id, Endpoint endpoint,
                size_t max_concurrent_handshakes, AcceptCallback on_accept, AdmitCallback admit)
      : transport_(transport), channel_(channel), id_(id), endpoint_(std::move(endpoint)),
        on_accept_(std::move(on_accept)), admit_(std::move(admit)), stop_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
        handshakes_(std::in_place, max_concurrent_handshakes) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~VerbsListener() override {
    stopping_ = true;
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(stop_fd_, &one, sizeof(one));
    thread_.join();
    handshakes_.reset();
    rdma_destroy_id(id_);
    rdma_destroy_event_channel(channel_);
    close(stop_fd_);
  }
  Endpoint endpoint() const override { return endpoint_; }

 private:
  void Loop();
  void Accept(rdma_cm_id* child);

  VerbsTransport* const transport_;
  rdma_event_channel* const channel_;
  rdma_cm_id* const id_;
  const Endpoint endpoint_;
  const AcceptCallback on_accept_;
  const AdmitCallback admit_;
  const int stop_fd_;
  std::atomic<bool> stopping_{false};
  std::optional<HandshakeThreads> handshakes_;  // reset: joined before id_ goes
  std::thread thread_;
};

class VerbsTransport : public Transport {
 public:
  VerbsTransport(const TransportOptions& options, std::vector<std::shared_ptr<DeviceContext>> devices)
      : options_(options),
        devices_(std::move(devices)),
        loops_(std::max<size_t>(options.io_threads, 1), VerbsConnection::LoopTick(options)) {
    // Threads short now: connections try again when they come (IoLoops::Next).
    absl::Status started = loops_.Start();
    if (!started.ok()) LOG(WARNING) << "tf_rdma: " << started;
  }

  ~VerbsTransport() override {
    std::vector<std::weak_ptr<VerbsConnection>> connections;
    {
      std::lock_guard<std::mutex> lock(mu_);
      connections.swap(connections_);
    }
    std::vector<std::shared_ptr<VerbsConnection>> closed;
    for (auto& weak : connections) {
      if (auto connection = weak.lock()) {
        connection->Close(absl::CancelledError("the local tf_rdma transport shut down"));
        closed.push_back(std::move(connection));
      }
    }
    // Their loops tell the peers why (REJECT) and see the work requests flushed before they stop
    // (loops_ goes next); all at once, so this waits about one connection's close.
    for (auto& connection : closed) connection->AwaitFinished();
  }

  Backend backend() const override { return Backend::kVerbs; }

  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateRegion(size_t bytes) override {
    const size_t length = std::max<size_t>(bytes, 1);
    void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate a region of ", bytes, " bytes: ", std::strerror(errno)));
    }
    // Only these regions are ever registered for remote access; every device in use gets one.
    std::vector<std::pair<ibv_pd*, std::shared_ptr<verbs::Registration>>> registrations;
    for (const auto& device : devices_) {
      auto registration = verbs::Registration::Create(
          device->pd, data, length, device->remote_region_access(),
          absl::StrCat("a receive region of ", bytes, " bytes (AllocateRegion)"));
      if (!registration.ok()) {
        registrations.clear();
        munmap(data, length);
        return registration.status();
      }
      registrations.emplace_back(device->pd, *std::move(registration));
    }
    return std::make_shared<verbs::VerbsRegion>(next_region_id_++, static_cast<char*>(data), bytes,
                                                std::move(registrations), devices_);
  }

  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Endpoint& endpoint, AcceptCallback on_accept,
                                                   AdmitCallback admit) override {
    absl::StatusOr<sockaddr_storage> address = ResolveIp(endpoint, true);
    if (!address.ok()) return address.status();
    absl::StatusOr<rdma_event_channel*> channel = NewEventChannel();
    if (!channel.ok()) return channel.status();
    CmId cm{*channel};
    if (rdma_create_id(cm.channel, &cm.id, nullptr, RDMA_PS_TCP) != 0) return CmError("rdma_create_id", "");
    if (rdma_bind_addr(cm.id, reinterpret_cast<sockaddr*>(&*address)) != 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot listen for verbs connections on ", endpoint.ToString(), ": rdma_bind_addr: ",
          std::strerror(errno), errno == EADDRNOTAVAIL || errno == ENODEV
                                    ? " (the address is not on an RDMA-capable interface)" : ""));
    }
    if (rdma_listen(cm.id, 128) != 0) return CmError("rdma_listen on", endpoint.ToString());
    Endpoint bound{endpoint.host.empty() ? "0.0.0.0" : endpoint.host, ntohs(rdma_get_src_port(cm.id))};
    auto listener = std::make_unique<VerbsListener>(this, cm.channel, cm.id, bound,
                                                    options_.limits.max_concurrent_handshakes,
                                                    std::move(on_accept), std::move(admit));
    cm.Release();
    return listener;
  }

  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Endpoint& endpoint) override {
    bool route_checked = false;
    return ConnectWithRetries(Backend::kVerbs, endpoint, options_.connect_timeout, [&](absl::Time deadline) {
      ConnectAttempt tried;
      absl::StatusOr<std::shared_ptr<VerbsConnection>> connection = ConnectOnce(endpoint, deadline, &tried.retry);
      if (connection.ok()) {
        tried.connection = std::shared_ptr<Connection>(*std::move(connection));
        return tried;
      }
      tried.connection = connection.status();
      // An address no RDMA device reaches (127.0.0.1, a plain Ethernet interface's) fails every
      // attempt alike, and how rdma_cm fails varies: name the cause at once instead of retrying
      // until the timeout. Asked after a failure only, so a connect that works pays nothing.
      if (!route_checked) {
        route_checked = true;
        absl::Status route = RouteTo(endpoint, endpoint.ToString());
        if (!route.ok()) {
          tried.connection = route;
          tried.retry = false;
        }
      }
      return tried;
    });
  }

  // The device rdma_cm resolved for `id`, checked against the overrides.
  absl::StatusOr<std::shared_ptr<DeviceContext>> DeviceFor(rdma_cm_id* id, const std::string& address) {
    std::shared_ptr<DeviceContext> device;
    for (const auto& candidate : devices_) {
      if (candidate->context == id->verbs) device = candidate;
    }
    if (device == nullptr) {
      std::vector<std::string> names;
      for (const auto& candidate : devices_) names.push_back(candidate->name);
      return verbs::DeviceMismatchError(absl::StrCat(
          address, " is reached through RDMA device ", verbs::DeviceName(id->verbs),
          ", but TF_RDMA_VERBS_DEVICE restricts tf_rdma to ", absl::StrJoin(names, ", "),
          ". RDMA devices here: ", verbs::DescribeDevices(), ". Name the peer by an IP address that ",
          absl::StrJoin(names, ", "), " reaches, or unset TF_RDMA_VERBS_DEVICE"));
    }
    if (options_.verbs.port != 0 && id->port_num != options_.verbs.port) {
      return verbs::DeviceMismatchError(absl::StrCat(
          address, " is reached through port ", static_cast<int>(id->port_num), " of ", device->name,
          ", but TF_RDMA_VERBS_PORT=", options_.verbs.port, ". Use the IP address of port ", options_.verbs.port,
          "'s interface, or unset TF_RDMA_VERBS_PORT"));
    }
    absl::Status port = verbs::CheckPortAndGid(id->verbs, id->port_num, options_.verbs.gid_index);
    if (!port.ok()) return port;
    return device;
  }

  void Track(const std::shared_ptr<VerbsConnection>& connection) {
    std::lock_guard<std::mutex> lock(mu_);
    connections_.erase(std::remove_if(connections_.begin(), connections_.end(),
                                      [](const auto& weak) { return weak.expired(); }),
                       connections_.end());
    connections_.push_back(connection);
  }

  const TransportOptions& options() const { return options_; }
  IoLoops& loops() { return loops_; }

 private:
  absl::StatusOr<std::shared_ptr<VerbsConnection>> ConnectOnce(const Endpoint& endpoint, absl::Time deadline,
                                                               bool* retry) {
    const std::string address = endpoint.ToString();
    absl::StatusOr<sockaddr_storage> destination = ResolveIp(endpoint, false);
    if (!destination.ok()) return destination.status();
    absl::StatusOr<rdma_event_channel*> channel = NewEventChannel();
    if (!channel.ok()) return channel.status();
    CmId cm{*channel};
    if (rdma_create_id(cm.channel, &cm.id, nullptr, RDMA_PS_TCP) != 0) return CmError("rdma_create_id", "");
    if (rdma_resolve_addr(cm.id, nullptr, reinterpret_cast<sockaddr*>(&*destination), 2000) != 0) {
      return CmError("rdma_resolve_addr for", address);
    }
    absl::StatusOr<CmEvent> event = WaitCmEvent(cm.channel, deadline, "address resolution for " + address);
    if (!event.ok()) return NoAnswer(event.status(), retry);
    if (event->type != RDMA_CM_EVENT_ADDR_RESOLVED) {
      *retry = true;
      return absl::UnavailableError(absl::StrCat(
          "rdma_cm cannot resolve ", endpoint.host, " to a local RDMA device (", rdma_event_str(event->type),
          ", status ", event->status, "); is it the IP address of the peer's RDMA interface (for RoCE, "
          "an address on the RDMA port's netdev), and does this host have an RDMA device on that network?"));
    }
    const uint8_t ack_timeout = 14;  // 4.096 us * 2^14 = 67 ms per retry
    rdma_set_option(cm.id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, const_cast<uint8_t*>(&ack_timeout),
                    sizeof(ack_timeout));
    if (rdma_resolve_route(cm.id, 2000) != 0) return CmError("rdma_resolve_route for", address);
    event = WaitCmEvent(cm.channel, deadline, "route resolution for " + address);
    if (!event.ok()) return NoAnswer(event.status(), retry);
    if (event->type != RDMA_CM_EVENT_ROUTE_RESOLVED) {
      *retry = true;
      return absl::UnavailableError(absl::StrCat("rdma_cm cannot resolve a route to ", address, " (",
                                                 rdma_event_str(event->type), ")"));
    }
    absl::StatusOr<std::shared_ptr<DeviceContext>> device = DeviceFor(cm.id, address);
    if (!device.ok()) return device.status();
    absl::StatusOr<std::shared_ptr<VerbsConnection>> created =
        VerbsConnection::Create(cm.id, cm.channel, *device, options_, options_.verbs, address);
    rdma_cm_id* id = cm.id;
    rdma_event_channel* events = cm.channel;
    if (!created.ok()) return created.status();
    cm.Release();  // the connection owns them now
    std::shared_ptr<VerbsConnection> connection = *created;
    absl::Status status = connection->Transition(IBV_QPS_INIT);
    if (!status.ok()) return status;
    rdma_conn_param param = ConnectionParameters(connection->qp_num());
    if (rdma_connect(id, &param) != 0) return CmError("rdma_connect to", address);
    event = WaitCmEvent(events, deadline, "connection response from " + address);
    if (!event.ok()) return NoAnswer(event.status(), retry);
    if (event->type != RDMA_CM_EVENT_CONNECT_RESPONSE) {
      *retry = event->type == RDMA_CM_EVENT_REJECTED || event->type == RDMA_CM_EVENT_UNREACHABLE ||
               event->type == RDMA_CM_EVENT_CONNECT_ERROR;
      return absl::UnavailableError(absl::StrCat("rdma_connect to ", address, ": ",
                                                 rdma_event_str(event->type), " (status ", event->status, ")"));
    }
    for (ibv_qp_state state : {IBV_QPS_RTR, IBV_QPS_RTS}) {
      status = connection->Transition(state);
      if (!status.ok()) {
        rdma_reject(id, nullptr, 0);
        return status;
      }
    }
    if (rdma_establish(id) != 0) return CmError("rdma_establish with", address);
    connection->Start(loops_);
    absl::StatusOr<PeerIdentity> peer =
        ClientHandshake(connection->handshake_channel(), Backend::kVerbs, options_);
    if (!peer.ok()) {
      connection->Close(peer.status());
      // The listener's admission said "not now" (RefusedForNow): another attempt may be admitted.
      *retry = RefusedForNow(peer.status());
      return peer.status();
    }
    connection->Established(*peer);
    Track(connection);
    return connection;
  }

  const TransportOptions options_;
  const std::vector<std::shared_ptr<DeviceContext>> devices_;
  std::atomic<uint32_t> next_region_id_{1};
  std::mutex mu_;
  std::vector<std::weak_ptr<VerbsConnection>> connections_;
  IoLoops loops_;  // the threads that serve every connection (TF_RDMA_IO_THREADS); stopped first
};

void VerbsListener::Loop() {
  while (!stopping_) {
    pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    poll(fds, 2, -1);
    rdma_cm_event* event = nullptr;
    while (!stopping_ && rdma_get_cm_event(channel_, &event) == 0) {
      const rdma_cm_event_type type = event->event;
      rdma_cm_id* child = event->id;
      rdma_ack_cm_event(event);
      if (type != RDMA_CM_EVENT_CONNECT_REQUEST) continue;
      const std::string source = IpAddressOf(rdma_get_peer_addr(child));
      absl::Status started = handshakes_->Start(source.empty() ? "an unknown address" : source,
                                                [this, child] { Accept(child); });
      if (!started.ok()) {
        rdma_reject(child, nullptr, 0);
        rdma_destroy_id(child);
        LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: refused a verbs connection on " << endpoint_.ToString()
                                     << ": " << started;
      }
    }
  }
}

void VerbsListener::Accept(rdma_cm_id* child) {
  const std::string address = absl::StrCat("client of ", endpoint_.ToString());
  const TransportOptions& options = transport_->options();
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  // Rate-limited as refusals for want of a handshake slot are (Loop): a client can make them.
  static UnloggedCount refusals;
  auto refuse = [&](const absl::Status& why) {
    refusals.Occurred();
    LOG_EVERY_N_SEC(WARNING, 10) << "tf_rdma: refused a verbs connection on " << endpoint_.ToString() << ": "
                                 << why << refusals.SinceLastLine();
  };
  absl::StatusOr<rdma_event_channel*> channel = NewEventChannel();
  if (!channel.ok()) {
    rdma_reject(child, nullptr, 0);
    rdma_destroy_id(child);
    return refuse(channel.status());
  }
  CmId cm{*channel, child};
  // Its own channel: this connection's events (ESTABLISHED, DISCONNECTED) reach it, not the listener.
  if (rdma_migrate_id(child, cm.channel) != 0) {
    rdma_reject(child, nullptr, 0);
    return refuse(CmError("rdma_migrate_id", ""));
  }
  absl::StatusOr<std::shared_ptr<DeviceContext>> device = transport_->DeviceFor(child, address);
  if (!device.ok()) {
    rdma_reject(child, nullptr, 0);
    return refuse(device.status());
  }
  absl::StatusOr<std::shared_ptr<VerbsConnection>> created =
      VerbsConnection::Create(child, cm.channel, *device, options, options.verbs, address);
  if (!created.ok()) {
    rdma_reject(child, nullptr, 0);
    return refuse(created.status());
  }
  rdma_event_channel* events = cm.channel;
  cm.Release();
  std::shared_ptr<VerbsConnection> connection = *created;
  absl::Status status;
  for (ibv_qp_state state : {IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS}) {
    if (status.ok()) status = connection->Transition(state);
  }
  if (!status.ok()) {
    rdma_reject(child, nullptr, 0);
    return refuse(status);
  }
  rdma_conn_param param = ConnectionParameters(connection->qp_num());
  if (rdma_accept(child, &param) != 0) return refuse(CmError("rdma_accept", ""));
  absl::StatusOr<CmEvent> event = WaitCmEvent(events, deadline, "ESTABLISHED from the client");
  if (!event.ok()) return refuse(event.status());
  if (event->type != RDMA_CM_EVENT_ESTABLISHED) {
    return refuse(absl::UnavailableError(absl::StrCat("expected ESTABLISHED, got ", rdma_event_str(event->type))));
  }
  connection->Start(transport_->loops());
  absl::StatusOr<PeerIdentity> peer =
      ServerHandshake(connection->handshake_channel(), Backend::kVerbs, options, admit_);
  if (!peer.ok()) {
    connection->Close(peer.status());
    // A peer told "not now" by the admission tries again: not worth a warning each time.
    if (absl::IsUnavailable(peer.status())) return;
    return refuse(peer.status());
  }
  connection->Established(*peer);
  transport_->Track(connection);
  on_accept_(connection);
}

}  // namespace

absl::Status VerbsAvailable(const TransportOptions& options) {
  // First, since every verbs call goes through the libraries this loads (rdma_libraries.h).
  absl::Status libraries = verbs::LoadRdmaLibraries();
  if (!libraries.ok()) return libraries;
  return verbs::CheckVerbsUsable(options.verbs);
}

absl::Status VerbsReaches(const std::string& host) {
  // Its route check calls into rdma-core, which must be loaded first (rdma_libraries.h).
  absl::Status libraries = verbs::LoadRdmaLibraries();
  if (!libraries.ok()) return libraries;
  // The port plays no part in routing; resolving needs one.
  return RouteTo(Endpoint{host, 1}, host);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const TransportOptions& options) {
  const VerbsSettings& settings = options.verbs;
  // Before anything is registered, as rdma-core requires.
  verbs::EnsureForkSafety();
  int count = 0;
  ibv_context** contexts = rdma_get_devices(&count);
  if (contexts == nullptr || count == 0) {
    if (contexts != nullptr) rdma_free_devices(contexts);
    return absl::UnimplementedError(
        "rdma_cm sees no RDMA device (rdma_get_devices returned none); is the rdma_ucm module loaded?");
  }
  std::vector<std::shared_ptr<DeviceContext>> devices;
  absl::Status problem;
  for (int i = 0; i < count; ++i) {
    const std::string name = verbs::DeviceName(contexts[i]);
    if (!settings.device.empty() && name != settings.device) continue;
    if (!settings.device.empty() && settings.port != 0) {
      // With both named, a bad port or GID index is reported now rather than at the first connect.
      problem = verbs::CheckPortAndGid(contexts[i], settings.port, settings.gid_index);
      if (!problem.ok()) break;
    }
    ibv_pd* pd = ibv_alloc_pd(contexts[i]);
    if (pd == nullptr) {
      problem = absl::UnavailableError(absl::StrCat("ibv_alloc_pd on ", name, ": ", std::strerror(errno)));
      break;
    }
    devices.push_back(std::make_shared<DeviceContext>(contexts[i], pd));
  }
  rdma_free_devices(contexts);
  if (!problem.ok()) return problem;
  if (devices.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("TF_RDMA_VERBS_DEVICE=", settings.device,
                                            " does not exist; devices found: ", verbs::DescribeDevices(),
                                            ". Use one of those names or unset it"));
  }
  return std::make_unique<VerbsTransport>(options, std::move(devices));
}

absl::StatusOr<VerbsLocalPort> ResolveVerbsLocalPort(const std::string& host, const Config& config) {
  absl::Status libraries = verbs::LoadRdmaLibraries();
  if (!libraries.ok()) return libraries;
  // The port plays no part in choosing the device; binding needs one.
  absl::StatusOr<sockaddr_storage> address = ResolveIp(Endpoint{host, 0}, true);
  if (!address.ok()) return address.status();
  CmId cm;
  absl::StatusOr<rdma_event_channel*> channel = NewEventChannel();
  if (!channel.ok()) return channel.status();
  cm.channel = *channel;
  if (rdma_create_id(cm.channel, &cm.id, nullptr, RDMA_PS_TCP) != 0) return CmError("rdma_create_id", host);
  if (rdma_bind_addr(cm.id, reinterpret_cast<sockaddr*>(&*address)) != 0) return CmError("rdma_bind_addr", host);
  if (cm.id->verbs == nullptr) {
    return verbs::DeviceMismatchError(absl::StrCat(
        host, " is no address of an RDMA device's interface, so rdma_cm resolves no device for it. RDMA "
        "devices here: ", verbs::DescribeDevices()));
  }
  VerbsLocalPort chosen{verbs::DeviceName(cm.id->verbs), cm.id->port_num, config.verbs.gid_index,
                        "TF_RDMA_VERBS_GID_INDEX"};
  if (!config.verbs.device.empty() && chosen.device != config.verbs.device) {
    return verbs::DeviceMismatchError(absl::StrCat(
        host, " is an address of RDMA device ", chosen.device, ", but TF_RDMA_VERBS_DEVICE=",
        config.verbs.device, ". Use an address of ", config.verbs.device, " or unset TF_RDMA_VERBS_DEVICE"));
  }
  if (config.verbs.port != 0 && chosen.port != config.verbs.port) {
    return verbs::DeviceMismatchError(absl::StrCat(
        host, " is an address of port ", chosen.port, " of ", chosen.device, ", but TF_RDMA_VERBS_PORT=",
        config.verbs.port, ". Use the IP address of port ", config.verbs.port,
        "'s interface, or unset TF_RDMA_VERBS_PORT"));
  }
  absl::Status port = verbs::CheckPortAndGid(cm.id->verbs, chosen.port, config.verbs.gid_index);
  if (!port.ok()) return port;
  if (chosen.gid_index >= 0) return chosen;
  // rdma_cm sends from the GID of the bound address, the RoCE v2 entry where the port has one
  // (the kernel's default RoCE mode), else the address's other entry (RoCE v1, InfiniBand).
  const ibv_gid& source = cm.id->route.addr.addr.ibaddr.sgid;
  ibv_port_attr port_attr{};
  if (ibv_query_port(cm.id->verbs, chosen.port, &port_attr) != 0) {
    return absl::UnavailableError(absl::StrCat("ibv_query_port on ", chosen.device, " port ", chosen.port,
                                               ": ", std::strerror(errno)));
  }
  for (int i = 0; i < port_attr.gid_tbl_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(cm.id->verbs, chosen.port, i, &entry, 0) != 0) continue;
    if (std::memcmp(entry.gid.raw, source.raw, sizeof(source.raw)) != 0) continue;
    if (chosen.gid_index < 0 || entry.gid_type == IBV_GID_TYPE_ROCE_V2) {
      chosen.gid_index = i;
      chosen.gid_chosen_by = absl::StrCat("the GID of ", host, ", as rdma_cm resolves it");
    }
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2) break;
  }
  if (chosen.gid_index < 0) {
    return verbs::DeviceMismatchError(absl::StrCat(
        "no GID of ", chosen.device, " port ", chosen.port, " is ", verbs::GidToString(source), ", the GID rdma_cm "
        "resolves for ", host, "; set TF_RDMA_VERBS_GID_INDEX"));
  }
  return chosen;
}

std::map<std::string, uint64_t> VerbsStatistics() {
  const verbs::RegistrationCacheStats stats = verbs::GetRegistrationCacheStats();
  const verbs::GrantTableStats grants = verbs::GetGrantTableStats();
  return {{"cache_hits", stats.hits},
          {"cache_misses", stats.misses},
          {"cache_evictions", stats.evictions},
          {"cache_invalidations", stats.invalidations},
          {"cache_uncached", stats.uncached},
          {"pinned_bytes", verbs::PinnedBytes()},
          {"grants_written", grants.written},
          {"grants_read", grants.read}};
}

}  // namespace tf_rdma
