// tf_rdma._transport: the transport layer for Python (tests, the bench, `python -m tf_rdma info`).
// Blocking calls release the GIL; errors become the exceptions of tf_rdma.errors.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <sys/resource.h>

#include "absl/strings/str_cat.h"
#include "cc/bench/steady_flow.h"
#include "cc/bench/transport_bench.h"
#include "cc/python/build_info.h"
#include "cc/python/status_exception.h"
#include "cc/transport/backend_registry.h"
#include "cc/transport/backend_selection.h"
#include "cc/transport/config.h"
#include "cc/transport/fork_guard.h"
#include "cc/transport/handshake.h"
#include "cc/transport/settings.h"
#include "cc/transport/stream/stream_transport.h"
#include "cc/transport/transport.h"
#include "cc/transport/wire.h"
#ifdef TF_RDMA_HAVE_VERBS
#include "cc/transport/verbs/verbs_messages.h"
#include "cc/transport/verbs/verbs_transport.h"
#endif

namespace py = pybind11;

namespace tf_rdma {
namespace {

Tag TagFromInt(const py::int_& value) {
  const py::int_ all_ones(~uint64_t{0});
  if (PyObject_RichCompareBool(value.ptr(), py::int_(0).ptr(), Py_LT) == 1) {
    throw py::value_error("tag must be >= 0");
  }
  const py::int_ high(value.attr("__rshift__")(64));
  if (PyObject_RichCompareBool(high.ptr(), all_ones.ptr(), Py_GT) == 1) {
    throw py::value_error("tag must fit in 128 bits");
  }
  const py::int_ low(value.attr("__and__")(all_ones));
  return Tag{high.cast<uint64_t>(), low.cast<uint64_t>()};
}

// Calls into a Connection in progress on this thread: a callback that finds one running ran inside
// that call (transport.h says which may), not on a transport thread.
thread_local int connection_calls_in_progress = 0;
class InsideConnectionCall {
 public:
  InsideConnectionCall() { ++connection_calls_in_progress; }
  ~InsideConnectionCall() { --connection_calls_in_progress; }
};

// One operation's outcome, waited for from Python.
class Pending {
 public:
  void Finish(absl::Status status, uint64_t value) {
    const bool inside_call = connection_calls_in_progress > 0;
    std::lock_guard<std::mutex> lock(mu_);
    finished_inside_call_ = inside_call;
    status_ = std::move(status);
    value_ = value;
    done_ = true;
    cv_.notify_all();
  }
  // Returns the value (bytes landed) or raises; TimeoutError if not done within `timeout` seconds.
  uint64_t Wait(double timeout) {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return done_; })) {
      ThrowIfError(absl::DeadlineExceededError(absl::StrCat("not done within ", timeout, " s")));
    }
    ThrowIfError(status_, value_);
    return value_;
  }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  bool finished_inside_call() {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_inside_call_;
  }

 private:
  std::mutex mu_;
  bool finished_inside_call_ = false;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  uint64_t value_ = 0;
};

struct GrantHandle {
  uint64_t id = 0;
  std::shared_ptr<Pending> pending = std::make_shared<Pending>();
};

struct WriteHandle {
  std::shared_ptr<Pending> pending = std::make_shared<Pending>();
  py::object keep_alive;  // the source buffer must outlive the write
};

// Closes the connection when Python lets go of it: its threads would otherwise keep it alive.
class PyConnection {
 public:
  explicit PyConnection(std::shared_ptr<Connection> connection) : connection_(std::move(connection)) {}
  ~PyConnection() {
    if (owner_.Inherited()) {
      LeakInherited(std::move(connection_));
      return;
    }
    connection_->Close(absl::CancelledError("the connection object was dropped"));
  }
  Connection& get() {
    ThrowIfError(owner_.CheckNotInherited(absl::StrCat("the connection to ", connection_->peer_name())));
    return *connection_;
  }
  std::shared_ptr<Connection> shared() {
    get();
    return connection_;
  }

 private:
  OwningProcess owner_;
  std::shared_ptr<Connection> connection_;
};

class PyTransport {
 public:
  explicit PyTransport(std::unique_ptr<Transport> transport) : transport_(std::move(transport)) {}
  ~PyTransport() {
    if (owner_.Inherited()) LeakInherited(std::move(transport_));
  }
  Transport& get() {
    ThrowIfError(owner_.CheckNotInherited("the transport"));
    return *transport_;
  }

 private:
  OwningProcess owner_;
  std::unique_ptr<Transport> transport_;
};

class PyListener {
 public:
  PyListener(Transport& transport, const std::string& endpoint) {
    listener_ = ValueOrThrow(transport.Listen(
        ValueOrThrow(Endpoint::Parse(endpoint)),
        [this](std::shared_ptr<Connection> connection) {
          std::lock_guard<std::mutex> lock(mu_);
          accepted_.push_back(std::move(connection));
          cv_.notify_all();
        },
        [this](const std::string& peer) { return Admit(peer); }));
  }
  ~PyListener() {
    if (owner_.Inherited()) {
      LeakInherited(std::move(listener_));
      LeakInherited(std::move(accepted_));
      return;
    }
    listener_.reset();
    for (auto& connection : accepted_) connection->Close(absl::CancelledError("never accepted"));
  }
  std::string endpoint() const { return listener_->endpoint().ToString(); }
  int port() const { return listener_->endpoint().port; }
  std::unique_ptr<PyConnection> Accept(double timeout) {
    ThrowIfError(owner_.CheckNotInherited(absl::StrCat("the listener on ", endpoint())));
    std::shared_ptr<Connection> connection;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return !accepted_.empty(); })) {
        connection = std::move(accepted_.front());
        accepted_.pop_front();
      }
    }
    if (!connection) {
      ThrowIfError(absl::DeadlineExceededError(
          absl::StrCat("no peer connected to ", endpoint(), " within ", timeout, " s")));
    }
    return std::make_unique<PyConnection>(std::move(connection));
  }
  // The listener's admission (AdmitCallback), as tests drive it: the next `times` handshakes of the
  // peer named `peer` are refused with `code` ("unavailable": not now; "permission_denied": never).
  void Refuse(const std::string& peer, const std::string& code, uint64_t times) {
    if (code != "unavailable" && code != "permission_denied") {
      ThrowIfError(absl::InvalidArgumentError(
          absl::StrCat("refusal code '", code, "': expected unavailable or permission_denied")));
    }
    const absl::StatusCode parsed =
        code == "unavailable" ? absl::StatusCode::kUnavailable : absl::StatusCode::kPermissionDenied;
    std::lock_guard<std::mutex> lock(mu_);
    refused_peer_ = peer;
    refusal_code_ = parsed;
    refusals_left_ = times;
  }
  // How many handshakes the admission refused so far.
  uint64_t refusals() {
    std::lock_guard<std::mutex> lock(mu_);
    return refusals_;
  }

 private:
  absl::Status Admit(const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refusals_left_ == 0 || peer != refused_peer_) return absl::OkStatus();
    --refusals_left_;
    ++refusals_;
    return absl::Status(refusal_code_, absl::StrCat("the test refuses ", peer, " ", refusals_left_, " more times"));
  }

  OwningProcess owner_;
  std::unique_ptr<Listener> listener_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Connection>> accepted_;
  std::string refused_peer_;
  absl::StatusCode refusal_code_ = absl::StatusCode::kUnavailable;
  uint64_t refusals_left_ = 0;
  uint64_t refusals_ = 0;
};

// The options a transport created now runs with: the TF_RDMA_* settings the environment has now
// (tests set them after import), then this process's name and key.
TransportOptions OptionsFromEnvironment(const std::string& name, const std::string& cluster_key) {
  TransportOptions options = TransportOptionsFrom(ValueOrThrow(LoadConfigFromEnvironment()));
  options.local_name = name;
  options.cluster_key = cluster_key;
  return options;
}

// A keyword argument of Transport() given as `given`, outside the bounds of the setting it stands for.
void ThrowOutOfBounds(const Setting& setting, const char* keyword, const std::string& given) {
  const std::string unit = SettingUnit(setting);
  ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
      "Transport(", keyword, "=", given, ") is outside the bounds of ", setting.name, ", ",
      setting.minimum, " to ", setting.maximum, unit.empty() ? "" : " ", unit,
      "; pass a value within them or leave it unset to take ", setting.name, " from the environment")));
}

// A keyword argument of Transport() in place of `setting`'s value, in the setting's unit.
int64_t CheckedOverride(const Setting& setting, const char* keyword, int64_t value) {
  if (value < setting.minimum || value > setting.maximum) ThrowOutOfBounds(setting, keyword, absl::StrCat(value));
  return value;
}

// A timeout given in seconds, in place of a setting in milliseconds. Compared as a double first:
// llround of NaN, an infinity or a value past 2^63 has no defined result.
absl::Duration SecondsOverride(const Setting& setting, const char* keyword, double seconds) {
  const double milliseconds = seconds * 1e3;
  if (!(milliseconds >= setting.minimum && milliseconds <= setting.maximum)) {
    ThrowOutOfBounds(setting, keyword, absl::StrCat(seconds));
  }
  return absl::Milliseconds(std::llround(milliseconds));
}

// Every row of the settings table, for tf_rdma.config.settings().
py::list SettingsTable() {
  static const char* const kKindNames[] = {"text", "count", "milliseconds", "microseconds", "bytes"};
  py::list out;
  for (const Setting* setting : settings::kAll) {
    const bool numeric = setting->kind != SettingKind::kText;
    out.append(py::make_tuple(setting->name, kKindNames[static_cast<int>(setting->kind)], DefaultText(*setting),
                              numeric ? py::object(py::int_(setting->minimum)) : py::none(),
                              numeric ? py::object(py::int_(setting->maximum)) : py::none(),
                              SettingUnit(*setting), setting->doc));
  }
  return out;
}

py::dict ConfigToDict(const Config& config) {
  py::dict d;
  d["backend"] = config.backend;
  d["peer_timeout"] = absl::ToDoubleSeconds(config.peer_timeout);
  d["connect_timeout"] = absl::ToDoubleSeconds(config.connect_timeout);
  d["secret"] = py::bytes(config.secret);
  d["port_offset"] = config.port_offset;
  d["verbs_device"] = config.verbs.device;
  d["verbs_port"] = config.verbs.port;
  d["verbs_gid_index"] = config.verbs.gid_index;
  d["verbs_poll_us"] = absl::ToInt64Microseconds(config.verbs.poll_window);
  d["stream_poll_us"] = absl::ToInt64Microseconds(config.stream_poll_window);
  d["io_threads"] = config.io_threads;
  d["max_concurrent_handshakes"] = config.limits.max_concurrent_handshakes;
  d["max_grants_per_peer"] = config.limits.max_grants_per_peer;
  d["shm_max_mapped_bytes_per_peer"] = config.limits.shm_max_mapped_bytes_per_peer;
  d["shm_max_mapped_bytes_total"] = config.limits.shm_max_mapped_bytes_total;
  d["max_connections_per_peer_name"] = config.limits.max_connections_per_peer_name;
  d["data_prefetch_elements"] = config.data_prefetch_elements;
  d["receive_pool_idle"] = absl::ToDoubleSeconds(config.receive_pool_idle);
  d["max_call_bytes"] = config.max_call_bytes;
  d["max_calls_per_peer"] = config.max_calls_per_peer;
  return d;
}

}  // namespace
}  // namespace tf_rdma

PYBIND11_MODULE(_transport, m) {
  using namespace tf_rdma;
  m.doc() = "tf_rdma's transport layer (receiver-granted one-sided writes) for Python.";

  RegisterStatusTranslator();

  m.attr("PROTOCOL_VERSION") = wire::kProtocolVersion;
  m.attr("BUILD_VERSION") = BuildVersion();
  AddBuildInfo(m);

  py::class_<MemoryRegion, std::shared_ptr<MemoryRegion>>(m, "Region", py::buffer_protocol())
      .def_property_readonly("id", &MemoryRegion::id)
      .def_property_readonly("size", &MemoryRegion::size)
      .def("__len__", &MemoryRegion::size)
      .def_buffer([](MemoryRegion& r) {
        return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size())}, {1}, /*readonly=*/false);
      });

  py::class_<GrantHandle>(m, "Grant")
      .def_readonly("id", &GrantHandle::id)
      .def("wait", [](GrantHandle& g, double timeout) { return g.pending->Wait(timeout); },
           py::arg("timeout") = 60.0, "Bytes that landed; raises if the grant failed.")
      .def("done", [](GrantHandle& g) { return g.pending->done(); })
      .def_property_readonly(
          "completed_inside_call", [](GrantHandle& g) { return g.pending->finished_inside_call(); },
          "Whether the callback ran inside a call on the connection (on its caller's thread).");

  py::class_<WriteHandle>(m, "Write")
      .def("wait", [](WriteHandle& w, double timeout) { w.pending->Wait(timeout); },
           py::arg("timeout") = 60.0)
      .def("done", [](WriteHandle& w) { return w.pending->done(); })
      .def_property_readonly(
          "completed_inside_call", [](WriteHandle& w) { return w.pending->finished_inside_call(); },
          "Whether the callback ran inside a call on the connection (on its caller's thread).");

  py::class_<PyConnection>(m, "Connection")
      .def_property_readonly("peer_name", [](PyConnection& c) { return ToPython(c.get().peer_name()); })
      .def_property_readonly("peer_build", [](PyConnection& c) { return ToPython(c.get().peer_build()); })
      .def_property_readonly("backend", [](PyConnection& c) { return BackendName(c.get().backend()); })
      .def("check", [](PyConnection& c) { ThrowIfError(c.get().health()); },
           "Raises the error that ended the connection, if any.")
      .def("grant",
           [](PyConnection& c, const py::int_& tag, std::shared_ptr<MemoryRegion> region,
              uint64_t offset, uint64_t capacity) {
             GrantHandle handle;
             auto pending = handle.pending;
             InsideConnectionCall inside;
             handle.id = c.get().Grant(TagFromInt(tag), std::move(region), offset, capacity,
                                       [pending](const GrantResult& r) { pending->Finish(r.status, r.length); });
             return handle;
           },
           py::arg("tag"), py::arg("region"), py::arg("offset"), py::arg("capacity"))
      .def("revoke", [](PyConnection& c, const GrantHandle& g) {
             InsideConnectionCall inside;
             c.get().Revoke(g.id);
           })
      .def("discard", [](PyConnection& c, const py::int_& tag) {
             const Tag parsed = TagFromInt(tag);
             InsideConnectionCall inside;
             c.get().DiscardPeerWrites(parsed);
           },
           py::arg("tag"),
           "Receiver side: the sender drops its writes under `tag`, waiting or to come; they complete as cancelled.")
      .def("withdraw", [](PyConnection& c, const py::int_& tag, const std::string& reason) {
             const Tag parsed = TagFromInt(tag);
             InsideConnectionCall inside;
             c.get().Withdraw(parsed, absl::AbortedError(reason));
           },
           py::arg("tag"), py::arg("reason") = "the sender's step was aborted",
           "Sender side: withdraws `tag`; its writes waiting or to come complete as cancelled, and the "
           "receiver's grants under it, made or to come, fail as aborted with `reason`.")
      .def("write",
           [](PyConnection& c, const py::int_& tag, const py::buffer& data) {
             py::buffer_info info = data.request();
             WriteHandle handle;
             handle.keep_alive = data;
             auto pending = handle.pending;
             InsideConnectionCall inside;
             c.get().Write(TagFromInt(tag), info.ptr, static_cast<uint64_t>(info.size * info.itemsize),
                           [pending](const absl::Status& s) { pending->Finish(s, 0); });
             return handle;
           },
           py::arg("tag"), py::arg("data"))
      .def("close", [](PyConnection& c, const std::string& reason) {
             InsideConnectionCall inside;
             c.get().Close(absl::CancelledError(reason));
           }, py::arg("reason") = "closed by its owner");

  py::class_<PyListener>(m, "Listener")
      .def_property_readonly("endpoint", &PyListener::endpoint)
      .def_property_readonly("port", &PyListener::port)
      .def("accept", &PyListener::Accept, py::arg("timeout") = 60.0);

  // Each keyword but backend, name, cluster_key and protocol_version stands for a TF_RDMA_* setting:
  // unset (None), the transport takes the setting from the environment as it is now, as
  // tf_rdma's servers do.
  py::class_<PyTransport>(m, "Transport")
      .def(py::init([](const std::string& backend, const std::string& name, const py::bytes& cluster_key,
                       std::optional<double> peer_timeout, std::optional<double> connect_timeout,
                       uint32_t protocol_version, std::optional<int64_t> max_concurrent_handshakes,
                       std::optional<int64_t> max_grants_per_peer,
                       std::optional<int64_t> shm_max_mapped_bytes_per_peer,
                       std::optional<int64_t> shm_max_mapped_bytes_total,
                       std::optional<int64_t> max_connections_per_peer_name, std::optional<int64_t> io_threads) {
             TransportOptions options = OptionsFromEnvironment(name, cluster_key);
             options.protocol_version_override = protocol_version;
             TransportLimits& limits = options.limits;
             if (peer_timeout) {
               options.peer_timeout = SecondsOverride(settings::kPeerTimeoutMs, "peer_timeout", *peer_timeout);
             }
             if (connect_timeout) {
               options.connect_timeout =
                   SecondsOverride(settings::kConnectTimeoutMs, "connect_timeout", *connect_timeout);
             }
             // A count keyword given: in place of its setting, within the setting's bounds.
             const auto take = [](const std::optional<int64_t>& given, const Setting& setting, const char* keyword,
                                  auto& field) {
               if (given) field = CheckedOverride(setting, keyword, *given);
             };
             take(max_concurrent_handshakes, settings::kMaxConcurrentHandshakes, "max_concurrent_handshakes",
                  limits.max_concurrent_handshakes);
             take(max_grants_per_peer, settings::kMaxGrantsPerPeer, "max_grants_per_peer", limits.max_grants_per_peer);
             take(shm_max_mapped_bytes_per_peer, settings::kShmMaxMappedBytesPerPeer, "shm_max_mapped_bytes_per_peer",
                  limits.shm_max_mapped_bytes_per_peer);
             take(shm_max_mapped_bytes_total, settings::kShmMaxMappedBytesTotal, "shm_max_mapped_bytes_total",
                  limits.shm_max_mapped_bytes_total);
             take(max_connections_per_peer_name, settings::kMaxConnectionsPerPeerName, "max_connections_per_peer_name",
                  limits.max_connections_per_peer_name);
             take(io_threads, settings::kIoThreads, "io_threads", options.io_threads);
             return std::make_unique<PyTransport>(
                 ValueOrThrow(CreateTransport(ValueOrThrow(ParseBackend(backend)), options)));
           }),
           py::arg("backend"), py::arg("name") = "", py::arg("cluster_key") = py::bytes(""),
           py::arg("peer_timeout") = py::none(), py::arg("connect_timeout") = py::none(),
           py::arg("protocol_version") = 0, py::arg("max_concurrent_handshakes") = py::none(),
           py::arg("max_grants_per_peer") = py::none(), py::arg("shm_max_mapped_bytes_per_peer") = py::none(),
           py::arg("shm_max_mapped_bytes_total") = py::none(),
           py::arg("max_connections_per_peer_name") = py::none(), py::arg("io_threads") = py::none(),
           "peer_timeout and connect_timeout in seconds; every keyword but name, cluster_key and "
           "protocol_version left unset takes its TF_RDMA_* variable from the environment as it is now.")
      .def_property_readonly("backend", [](PyTransport& t) { return BackendName(t.get().backend()); })
      .def("allocate_region",
           [](PyTransport& t, size_t bytes) { return ValueOrThrow(t.get().AllocateRegion(bytes)); })
      .def("listen", [](PyTransport& t, const std::string& endpoint) {
             return std::make_unique<PyListener>(t.get(), endpoint);
           }, py::keep_alive<0, 1>())
      .def("connect", [](PyTransport& t, const std::string& endpoint) {
             Transport& transport = t.get();
             auto parsed = ValueOrThrow(Endpoint::Parse(endpoint));
             std::shared_ptr<Connection> connection;
             {
               py::gil_scoped_release release;
               connection = ValueOrThrow(transport.Connect(parsed));
             }
             return std::make_unique<PyConnection>(std::move(connection));
           });

  m.def("backends", [] {
    py::list out;
    for (const BackendRegistration& registration : RegisteredBackends()) {
      out.append(py::make_tuple(BackendName(registration.backend), registration.stream_wire));
    }
    return out;
  }, "(name, carries the stream wire format) of every backend this build has, in listening order.");
  // Both with the TF_RDMA_* settings the environment has now, as a transport created now would.
  m.def("backend_available", [](const std::string& name) {
    absl::Status status = BackendAvailable(
        ValueOrThrow(ParseBackend(name)), TransportOptionsFrom(ValueOrThrow(LoadConfigFromEnvironment())));
    return py::make_tuple(status.ok(), std::string(status.message()));
  });
  m.def("choose_backend", [](const std::string& requested, const std::string& host) {
    BackendChoice choice = ValueOrThrow(
        ChooseBackend(requested, host, TransportOptionsFrom(ValueOrThrow(LoadConfigFromEnvironment()))));
    return py::make_tuple(BackendName(choice.backend), choice.reason);
  });
  m.def("load_config", [] { return ConfigToDict(ValueOrThrow(LoadConfigFromEnvironment())); });
  m.def("parse_config", [](const std::map<std::string, std::string>& environment) {
    return ConfigToDict(ValueOrThrow(ParseConfig(environment)));
  });
  m.def("cluster_key", [](const py::bytes& secret) {
    return py::bytes(ValueOrThrow(ClusterKey(std::string(secret))));
  }, "The key every task derives from TF_RDMA_SECRET (HKDF-SHA-256), as the handshake proves it.");
  m.def("settings", &SettingsTable,
        "(name, kind, default, minimum, maximum, unit, doc) of every TF_RDMA_* setting "
        "(cc/transport/settings.h); minimum and maximum are None for text settings.");
  m.def("parse_size", [](const std::string& text) { return ValueOrThrow(ParseSize(text)); },
        "A size in bytes: 4096, 64K or 64KiB, 1 GiB, 1T or 1TiB (binary units, any case).");
  m.def("format_size", &FormatSize, "1048576 -> '1 MiB': the largest binary unit that divides it, else bytes.");
  m.def("stream_stats", &StreamStatistics,
        "Connections the tcp and shm backends started in this process (TensorFlow's too), connected "
        "and accepted alike.");
  m.def("verbs_local_port", [](const std::string& host, const std::map<std::string, std::string>& environment) {
    // (device, port, GID index, what chose the GID) of the verbs backend's connections from `host`
    // under the TF_RDMA_* settings of `environment`.
#ifdef TF_RDMA_HAVE_VERBS
    const Config config = ValueOrThrow(ParseConfig(environment));
    VerbsLocalPort chosen;
    {
      py::gil_scoped_release release;
      chosen = ValueOrThrow(ResolveVerbsLocalPort(host, config));
    }
    return py::make_tuple(chosen.device, chosen.port, chosen.gid_index, chosen.gid_chosen_by);
#else
    return ValueOrThrow(absl::StatusOr<py::tuple>(absl::UnimplementedError("this tf_rdma build has no verbs backend")));
#endif
  });
  m.def("verbs_stats", [] {
    // Counters of the verbs backend (registration cache, grant tables); empty when it is not built in.
    std::map<std::string, uint64_t> stats;
#ifdef TF_RDMA_HAVE_VERBS
    stats = VerbsStatistics();
#endif
    return stats;
  });
  m.def("memlock_limit", [] {
    rlimit limit{};
    getrlimit(RLIMIT_MEMLOCK, &limit);
    return py::make_tuple(limit.rlim_cur == RLIM_INFINITY ? -1 : static_cast<int64_t>(limit.rlim_cur),
                          limit.rlim_max == RLIM_INFINITY ? -1 : static_cast<int64_t>(limit.rlim_max));
  });
  m.def("bench_serve",
        [](const std::string& backend, const bench::BenchPlan& plan, const std::string& host, uint16_t port,
           const std::string& cluster_key, py::function ready) {
          TransportOptions options = OptionsFromEnvironment("bench-receiver", cluster_key);
          py::gil_scoped_release release;
          ThrowIfError(bench::Serve(ValueOrThrow(ParseBackend(backend)), options, plan, host, port,
                                    [&](uint16_t transport_port, uint16_t baseline_port) {
                                      py::gil_scoped_acquire acquire;
                                      ready(transport_port, baseline_port);
                                    }));
        });
  m.def("bench_drive",
        [](const std::string& backend, const bench::BenchPlan& plan, const std::string& endpoint,
           const std::string& baseline_endpoint, const std::string& cluster_key) {
          TransportOptions options = OptionsFromEnvironment("bench-sender", cluster_key);
          absl::StatusOr<bench::BenchReport> report;
          {
            py::gil_scoped_release release;
            report = bench::Drive(ValueOrThrow(ParseBackend(backend)), options, plan,
                                  ValueOrThrow(Endpoint::Parse(endpoint)),
                                  ValueOrThrow(Endpoint::Parse(baseline_endpoint)));
          }
          bench::BenchReport r = ValueOrThrow(std::move(report));
          py::list throughput, latency;
          for (const auto& s : r.throughput) {
            py::dict d;
            d["size"] = s.size;
            d["iterations"] = s.iterations;
            d["transport_gbps"] = s.transport_gbps;
            d["tcp_socket_gbps"] = s.tcp_socket_gbps;
            d["memcpy_gbps"] = s.memcpy_gbps;
            throughput.append(d);
          }
          for (const auto& l : r.latency) {
            py::dict d;
            d["size"] = l.size;
            d["transport_us"] = l.transport_us;
            d["tcp_socket_us"] = l.tcp_socket_us;
            d["transport_cpu_percent"] = l.transport_cpu_percent;
            latency.append(d);
          }
          py::dict out;
          out["throughput"] = throughput;
          out["latency"] = latency;
          return out;
        });

  py::class_<bench::SteadyFlow>(m, "SteadyFlow",
                                "Steady traffic on many connections, driven by the transport's threads "
                                "(cc/bench/steady_flow.h).")
      .def(py::init([](const std::string& side, const std::vector<PyConnection*>& connections,
                       std::vector<std::shared_ptr<MemoryRegion>> regions, uint64_t size, int depth) {
             if (side != "receive" && side != "send") throw py::value_error("side must be 'receive' or 'send'");
             std::vector<std::shared_ptr<Connection>> shared;
             for (PyConnection* connection : connections) shared.push_back(connection->shared());
             return ValueOrThrow(bench::SteadyFlow::Start(
                 side == "receive" ? bench::SteadyFlow::Side::kReceive : bench::SteadyFlow::Side::kSend,
                 std::move(shared), std::move(regions), size, depth));
           }),
           py::arg("side"), py::arg("connections"), py::arg("regions") = std::vector<std::shared_ptr<MemoryRegion>>{}, py::arg("size"),
           py::arg("depth") = 4)
      .def("bytes", &bench::SteadyFlow::Bytes, "Bytes landed (receive) or sent, per connection.")
      .def("stop", [](bench::SteadyFlow& flow, double timeout) {
             absl::Status status;
             {
               py::gil_scoped_release release;
               status = flow.Stop(absl::Seconds(timeout));
             }
             ThrowIfError(status);
           }, py::arg("timeout") = 30.0);

  py::class_<bench::BenchPlan>(m, "BenchPlan")
      .def(py::init<>())
      .def_readwrite("sizes", &bench::BenchPlan::sizes)
      .def_readwrite("latency_sizes", &bench::BenchPlan::latency_sizes)
      .def_readwrite("bytes_per_size", &bench::BenchPlan::bytes_per_size)
      .def_readwrite("latency_round_trips", &bench::BenchPlan::latency_round_trips)
      .def_readwrite("depth", &bench::BenchPlan::depth);

  // What only the tests call, kept out of the transport's API: a listener's admission driven by
  // hand, and the decoders the fuzz tests feed directly.
  py::module_ testing = m.def_submodule("_testing", "tf_rdma's test hooks; not an API.");
  testing.def("refuse", &PyListener::Refuse, py::arg("listener"), py::arg("peer"), py::arg("code"),
              py::arg("times"));
  testing.def("refusals", &PyListener::refusals, py::arg("listener"));
  testing.def("decode_frame", [](const py::bytes& data) {
    // The wire decoder; returns the frame type's name or raises.
    const std::string bytes = data;
    if (bytes.size() < wire::kHeaderLength) {
      ThrowIfError(absl::DataLossError("frame shorter than its header"));
    }
    auto header = ValueOrThrow(wire::DecodeHeader(std::string_view(bytes).substr(0, wire::kHeaderLength)));
    const std::string_view body = std::string_view(bytes).substr(wire::kHeaderLength);
    if (body.size() != header.body_length) {
      ThrowIfError(absl::DataLossError(absl::StrCat("body is ", body.size(), " bytes, header says ",
                                                    header.body_length)));
    }
    auto frame = ValueOrThrow(wire::DecodeBody(header.type, body));
    return std::string(wire::FrameTypeName(frame.type));
  });

#ifdef TF_RDMA_HAVE_VERBS
  testing.def("decode_verbs_message", [](const py::bytes& data) {
    // The decoder every message a verbs peer SENDs goes through; returns the message's kind or
    // raises.
    const verbs::Message message = ValueOrThrow(verbs::DecodeMessage(std::string(data)));
    if (std::holds_alternative<verbs::RegionMessage>(message)) return std::string("REGION");
    if (std::holds_alternative<verbs::GrantTableMessage>(message)) return std::string("GRANT_TABLE");
    return std::string(wire::FrameTypeName(std::get<wire::Frame>(message).type));
  });
  testing.def("decode_verbs_grant_record", [](const py::bytes& data) {
    // The decoder of what a verbs peer RDMA-writes into our grant table; returns the grant's fields.
    const wire::Grant grant = ValueOrThrow(verbs::DecodeGrantRecord(std::string(data)));
    return py::make_tuple(grant.grant_id, grant.region_id, grant.offset, grant.capacity);
  });
#endif
}
