// tf_rdma._tensorflow: the TensorFlow side of tf_rdma. Loading this module registers tf_rdma's
// server protocol ("grpc+tf_rdma", cc/tf/server/) and tf.data service data transfer protocol
// ("tf_rdma", cc/tf/data/) with the TensorFlow in the process; its functions
// configure the servers created next and read every server's stats.
#include <map>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cc/python/build_info.h"
#include "cc/python/status_exception.h"
#ifdef TF_RDMA_HAVE_DATA_SERVICE
#include "cc/tf/data/rdma_data_transfer.h"
#endif
#include "cc/tf/runtime/runtime.h"
#include "cc/tf/server/rdma_server.h"

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
  d["bytes_sent_by_kind"] = s.bytes_sent_by_kind;
  d["bytes_received_by_kind"] = s.bytes_received_by_kind;
  d["dead_tensors"] = s.dead_tensors;
  d["grants"] = s.grants;
  d["regrants"] = s.regrants;
  d["errors"] = s.errors;
  d["sends_discarded"] = s.sends_discarded;
  d["resends"] = s.resends;
  d["connects"] = s.connects;
  d["probes"] = s.probes;
  d["fused_messages_sent"] = s.fused_messages_sent;
  d["fused_messages_received"] = s.fused_messages_received;
  d["calls_made"] = s.calls_made;
  d["calls_served"] = s.calls_served;
  d["calls_on_grpc"] = s.calls_on_grpc;
  return d;
}

py::dict ServerStats(Runtime& runtime) {
  const StatsSnapshot s = runtime.stats().Snapshot();
  py::dict out;
  out["task"] = runtime.local_task();
  out["fallback"] = s.fallback;
  out["receives_planned"] = s.receives_planned;
  out["live_steps"] = runtime.stats().live_steps();
  out["failed_steps_kept"] = runtime.stats().failed_steps_kept();
  py::dict peers;
  for (const auto& [task, peer] : s.peers) peers[py::str(task)] = PeerToDict(peer);
  out["peers"] = peers;
  py::dict pools;
  for (const auto& [backend, usage] : runtime.receive_pools().Usage()) {
    py::dict pool;
    pool["region_bytes"] = usage.region_bytes;
    pool["buffers_in_use"] = usage.buffers_in_use;
    pool["bytes_in_use"] = usage.bytes_in_use;
    pools[py::str(BackendName(backend))] = pool;
  }
  out["receive_pools"] = pools;
  return out;
}

}  // namespace
}  // namespace tf_rdma

PYBIND11_MODULE(_tensorflow, m) {
  using namespace tf_rdma;
  RegisterStatusTranslator();
  m.attr("PROTOCOL") = kProtocol;
  AddBuildInfo(m);
  m.def("set_address_overrides", &SetAddressOverrides, py::arg("overrides"));
  m.attr("RECEIVE_POOL_SLAB_BYTES") =
      py::make_tuple(RuntimeOptions{}.min_slab_bytes, RuntimeOptions{}.max_slab_bytes);
  m.def("tasks_of",
        [](const py::bytes& serialized_cluster_def, const AddressOverrides& overrides) {
          tensorflow::ClusterDef cluster;
          if (!cluster.ParseFromString(std::string(serialized_cluster_def))) {
            ThrowIfError(absl::InvalidArgumentError("not a serialized ClusterDef"));
          }
          std::vector<std::tuple<std::string, std::string, int, int>> out;
          const Config config = ValueOrThrow(LoadConfigFromEnvironment());
          for (const TaskAddress& t : ValueOrThrow(TasksOf(cluster, config, overrides))) {
            out.emplace_back(t.task, t.host, t.grpc_port, t.rdma_port);
          }
          return out;
        },
        py::arg("serialized_cluster_def"), py::arg("overrides"));
#ifndef TF_RDMA_DATA_SERVICE_TENSORFLOW
#define TF_RDMA_DATA_SERVICE_TENSORFLOW "(the TensorFlow source tree it was built in)"
#endif
  m.attr("DATA_SERVICE_TENSORFLOW") = TF_RDMA_DATA_SERVICE_TENSORFLOW;
#ifdef TF_RDMA_HAVE_DATA_SERVICE
  m.attr("DATA_TRANSFER_PROTOCOL") = kDataTransferProtocol;
  m.def("data_transfer_fallbacks", &DataTransferFallbacks);
#else
  m.attr("DATA_TRANSFER_PROTOCOL") = py::none();  // setup.py builds it for some releases only
  m.def("data_transfer_fallbacks", [] { return std::map<std::string, uint64_t>(); });
#endif
  m.def("server_stats", [] {
    py::list out;
    for (const auto& runtime : Runtime::Running()) out.append(ServerStats(*runtime));
    return out;
  });
  m.def("reset_stats", [] {
    for (const auto& runtime : Runtime::Running()) runtime->stats().Reset();
  });
}
