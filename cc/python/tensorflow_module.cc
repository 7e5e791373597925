// tf_rdma._tensorflow: the TensorFlow side of tf_rdma. Loading this module registers the RdmaSend
// and RdmaRecv kernels and the graph pass with the TensorFlow in the process; its functions start
// the per-process runtime and read its stats.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cc/python/status_exception.h"
#include "cc/tf/runtime/runtime.h"
#include "cc/transport/config.h"

namespace py = pybind11;

namespace tf_rdma {
namespace {

py::dict PeerToDict(const PeerStats& s) {
  py::dict d;
  d["backend"] = s.backend;
  d["backend_reason"] = s.backend_reason;
  d["tensors_sent"] = s.tensors_sent;
  d["bytes_sent"] = s.bytes_sent;
  d["tensors_received"] = s.tensors_received;
  d["bytes_received"] = s.bytes_received;
  d["dead_tensors"] = s.dead_tensors;
  d["grants"] = s.grants;
  d["regrants"] = s.regrants;
  d["errors"] = s.errors;
  d["sends_discarded"] = s.sends_discarded;
  d["connects"] = s.connects;
  return d;
}

}  // namespace
}  // namespace tf_rdma

PYBIND11_MODULE(_tensorflow, m) {
  using namespace tf_rdma;
  RegisterStatusTranslator();
  m.def("start_runtime",
        [](const std::string& local_task, const std::vector<std::tuple<std::string, std::string, int, int>>& tasks,
           const py::bytes& cluster_key) {
          RuntimeOptions options;
          options.config = ValueOrThrow(LoadConfigFromEnvironment());
          options.local_task = local_task;
          options.cluster_key = cluster_key;
          for (const auto& [task, host, grpc_port, rdma_port] : tasks) {
            options.tasks.push_back(TaskAddress{task, host, static_cast<uint16_t>(grpc_port),
                                                static_cast<uint16_t>(rdma_port)});
          }
          py::gil_scoped_release release;
          ThrowIfError(Runtime::Start(options));
        },
        py::arg("local_task"), py::arg("tasks"), py::arg("cluster_key"));
  m.def("running", [] { return Runtime::Get() != nullptr; });
  m.def("stats", [] {
    py::dict out;
    Runtime* runtime = Runtime::Get();
    if (runtime == nullptr) return out;
    const StatsSnapshot s = runtime->stats().Snapshot();
    out["task"] = runtime->local_task();
    out["graphs_rewritten"] = s.graphs_rewritten;
    out["edges_rewritten"] = s.edges_rewritten;
    out["receives_planned"] = s.receives_planned;
    out["edges_fallback"] = s.edges_fallback;
    py::dict peers;
    for (const auto& [task, peer] : s.peers) peers[py::str(task)] = PeerToDict(peer);
    out["peers"] = peers;
    return out;
  });
  m.def("reset_stats", [] {
    if (Runtime* runtime = Runtime::Get()) runtime->stats().Reset();
  });
}
