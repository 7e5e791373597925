// One TensorFlow server's side of tf_rdma. Each tf_rdma server (cc/tf/server/) owns one, so several
// servers in one process each have their own endpoint. The runtime starts and holds the parts the
// layers above ask, one question each:
//   who is where               task_addresses()   TaskAddresses  (task_addresses.h)
//   a connection to a task     connections()      Connections    (connections.h)
//   where a peer's tensors land receive_pools()    ReceivePools   (receive_pools.h)
//   what a transfer carried    learned_sizes()    LearnedSizes   (learned_sizes.h)
//   what tf_rdma did           stats()            Stats          (stats.h)
//   each backend's transport   transports()       Transports     (transports.h)
#ifndef TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_
#define TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/tf/runtime/connections.h"
#include "cc/tf/runtime/learned_sizes.h"
#include "cc/tf/runtime/receive_pools.h"
#include "cc/tf/runtime/stats.h"
#include "cc/tf/runtime/task_addresses.h"
#include "cc/tf/runtime/transports.h"
#include "cc/transport/config.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

struct RuntimeOptions {
  std::string local_task;
  std::vector<TaskAddress> tasks;  // must include local_task
  Config config;
  // Bounds of the slabs a peer's receive pool grows by (BufferPool).
  uint64_t min_slab_bytes = 1ull << 20;
  uint64_t max_slab_bytes = 64ull << 20;
  // Set for a server that anyone holding the cluster key may use (a tf.data service worker): every
  // accepted connection goes to it, whatever name its peer claims, instead of the task pairing rules.
  // The key comes from TF_RDMA_SECRET alone (TransportOptions::cluster_key), so any process given
  // that secret may, whether or not the cluster names it.
  AcceptCallback serve_any_peer;
};

class Runtime {
 public:
  // Listens for this task's peers, registers the runtime for stats() and starts its one thread
  // that frees the receive pools' idle regions. Fails if the listener cannot bind (e.g. the port
  // is taken by another process).
  static absl::StatusOr<std::shared_ptr<Runtime>> Start(const RuntimeOptions& options);
  // Every runtime started in this process, in start order (they live until the process exits:
  // TensorFlow servers are never torn down, and transfers may run until then).
  static std::vector<std::shared_ptr<Runtime>> Running();

  const std::string& local_task() const { return options_.local_task; }
  // The port every backend's listener took (the one asked for, or the first free one if 0).
  uint16_t port() const { return port_; }
  const Config& config() const { return options_.config; }
  // Adds or updates tasks (a session or an eager context may bring a cluster of a different shape:
  // a client job, a renamed job). A task whose address changed loses its old connection.
  void UpdateTasks(const std::vector<TaskAddress>& tasks);

  TaskAddresses& task_addresses() { return task_addresses_; }
  Connections& connections() { return connections_; }
  ReceivePools& receive_pools() { return receive_pools_; }
  LearnedSizes& learned_sizes() { return learned_sizes_; }
  Stats& stats() { return stats_; }
  Transports& transports() { return transports_; }

 private:
  explicit Runtime(RuntimeOptions options);

  const RuntimeOptions options_;
  uint16_t port_ = 0;
  Stats stats_;
  TaskAddresses task_addresses_;
  LearnedSizes learned_sizes_;
  // Declared in the order they depend on each other, so each goes before what it uses.
  Transports transports_;
  ReceivePools receive_pools_;
  Connections connections_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_
