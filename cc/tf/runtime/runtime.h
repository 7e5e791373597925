// The per-process side of tf_rdma in a TensorFlow cluster: which tasks exist and where their
// tf_rdma listeners are, one connection per pair of tasks, receive pools per backend, and stats.
// The graph pass asks it which edges it may rewrite; the kernels ask it for connections and
// buffers. Started once per process by tf_rdma.Server (or, in a client that only builds graphs,
// without listening).
#ifndef TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_
#define TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/tf/runtime/buffer_pool.h"
#include "cc/tf/runtime/stats.h"
#include "cc/transport/config.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

struct TaskAddress {
  std::string task;  // "/job:worker/replica:0/task:1"
  std::string host;
  uint16_t grpc_port = 0;
  uint16_t rdma_port = 0;
};

struct RuntimeOptions {
  // This process's task; empty in a client that builds graphs for the cluster but moves no tensor.
  std::string local_task;
  std::vector<TaskAddress> tasks;
  Config config;
  std::string cluster_key;
  uint64_t slab_bytes = 64ull << 20;
};

class Runtime {
 public:
  // Starts the process-wide runtime. Starting again with the same cluster and task is a no-op;
  // with a different one it is an error (one process, one cluster).
  static absl::Status Start(const RuntimeOptions& options);
  static Runtime* Get();  // null until started
  // The runtime, or the error a kernel reports when it runs in a process that never started it.
  static absl::StatusOr<Runtime*> ForKernels();

  // Whether tensors to or from `task` can go over tf_rdma (it is a task of the cluster).
  bool KnowsTask(const std::string& task) const;
  const std::string& local_task() const { return options_.local_task; }

  // The connection to `peer_task`, established on first use; `done` runs on a runtime or
  // transport thread. The task with the smaller name connects, the other accepts, so each pair
  // shares one connection for both directions.
  using ConnectionCallback = std::function<void(absl::StatusOr<std::shared_ptr<Connection>>)>;
  void WithConnection(const std::string& peer_task, ConnectionCallback done);

  absl::StatusOr<BufferPool*> PoolFor(Backend backend);
  Stats& stats() { return stats_; }

 private:
  struct Peer {
    TaskAddress address;
    std::shared_ptr<Connection> connection;
    bool connecting = false;
    std::vector<ConnectionCallback> waiters;
  };

  explicit Runtime(RuntimeOptions options) : options_(std::move(options)) {}
  absl::Status Listen();
  absl::StatusOr<Transport*> TransportFor(Backend backend);
  void OnAccepted(std::shared_ptr<Connection> connection);
  void Establish(const std::string& peer_task);
  absl::StatusOr<std::shared_ptr<Connection>> ConnectTo(const TaskAddress& peer);
  absl::StatusOr<std::shared_ptr<Connection>> AwaitFrom(const TaskAddress& peer);
  absl::Status DiagnoseMissingPeer(const TaskAddress& peer, const absl::Status& cause) const;

  const RuntimeOptions options_;
  mutable std::mutex mu_;
  std::condition_variable accepted_;
  std::map<Backend, std::unique_ptr<Transport>> transports_;
  std::map<Backend, std::shared_ptr<BufferPool>> pools_;
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::map<std::string, Peer> peers_;
  Stats stats_;
};

// "/job:worker/replica:0/task:1/device:CPU:0" -> "/job:worker/replica:0/task:1".
absl::StatusOr<std::string> TaskOfDevice(const std::string& device);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_
