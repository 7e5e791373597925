#include "cc/tf/server/rdma_server.h"

#include <memory>
#include <mutex>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/calls/eager_calls.h"
#include "cc/tf/calls/rdma_worker_cache.h"
#include "cc/tf/calls/worker_calls.h"
#include "cc/tf/collective/rdma_collective.h"
#include "cc/tf/rendezvous/rdma_rendezvous_mgr.h"
#include "tensorflow/core/distributed_runtime/rpc/grpc_server_lib.h"
#include "tensorflow/core/distributed_runtime/server_lib.h"
#include "tensorflow/core/protobuf/tensorflow_server.pb.h"

namespace tf_rdma {
namespace {

std::mutex overrides_mu;
AddressOverrides& Overrides() {
  static auto* overrides = new AddressOverrides();
  return *overrides;
}

AddressOverrides CurrentOverrides() {
  std::lock_guard<std::mutex> lock(overrides_mu);
  return Overrides();
}

std::string TaskName(const std::string& job, int replica, int index) {
  return absl::StrCat("/job:", job, "/replica:", replica, "/task:", index);
}

class RdmaServer : public tensorflow::GrpcServer {
 public:
  static absl::Status Create(const tensorflow::ServerDef& server_def, tensorflow::DeviceMgr* local_device_mgr,
                             std::unique_ptr<tensorflow::ServerInterface>* out) {
    absl::StatusOr<Config> config = LoadConfigFromEnvironment();
    if (!config.ok()) return config.status();
    absl::StatusOr<std::vector<TaskAddress>> tasks = TasksOf(server_def.cluster(), *config, CurrentOverrides());
    if (!tasks.ok()) return tasks.status();
    RuntimeOptions options;
    options.local_task = TaskName(server_def.job_name(), server_def.replica(), server_def.task_index());
    options.tasks = *std::move(tasks);
    options.config = *config;
    // tf_rdma listens before TensorFlow serves, so a peer that reaches this task's TensorFlow
    // server also finds its tf_rdma listener.
    absl::StatusOr<std::shared_ptr<Runtime>> runtime = Runtime::Start(options);
    // TensorFlow reports a server that cannot take its port as UnknownError ("Could not start gRPC
    // server"), and code written for it catches that class: a listener that cannot start is the same
    // situation.
    if (!runtime.ok() && absl::IsUnavailable(runtime.status())) {
      return absl::UnknownError(runtime.status().message());
    }
    if (!runtime.ok()) return runtime.status();
    std::unique_ptr<RdmaServer> server(new RdmaServer(server_def, *runtime));
    absl::Status initialized = server->Init(local_device_mgr);
    if (!initialized.ok()) return initialized;
    *out = std::move(server);
    return absl::OkStatus();
  }

  // TensorFlow 2.21 rebuilds the collective manager here without consulting the options: put
  // tf_rdma's back.
  absl::Status UpdateServerDef(const tensorflow::ServerDef& server_def) override {
    absl::Status updated = GrpcServer::UpdateServerDef(server_def);
    if (!updated.ok()) return updated;
    worker_env()->collective_executor_mgr = NewRdmaCollectiveExecutorMgr(
        server_def.default_session_config(), worker_env()->device_mgr, master_env()->worker_cache,
        TaskName(server_def.job_name(), server_def.replica(), server_def.task_index()), runtime_);
    return absl::OkStatus();
  }

  // Remote functions call back into a client's master context: in gRPC's eager service and in
  // tf_rdma's, whichever their calls reach.
  absl::Status AddMasterEagerContextToEagerService(const uint64_t context_id,
                                                   tensorflow::EagerContext* context) override {
    absl::Status added = GrpcServer::AddMasterEagerContextToEagerService(context_id, context);
    if (!added.ok()) return added;
    return eager_->AddMasterContext(context_id, context);
  }

 protected:
  // Every cluster this server will talk to passes through here (its own, a session's, an eager
  // context's), so the runtime learns where tasks it was not started with listen.
  absl::Status WorkerCacheFactory(const tensorflow::WorkerCacheFactoryOptions& options,
                                  tensorflow::WorkerCacheInterface** worker_cache) override {
    absl::StatusOr<std::vector<TaskAddress>> tasks = TasksOf(options.cluster_def, runtime_->config(), CurrentOverrides());
    if (!tasks.ok()) return tasks.status();
    runtime_->UpdateTasks(*tasks);
    tensorflow::WorkerCacheInterface* grpc_cache = nullptr;
    absl::Status made = GrpcServer::WorkerCacheFactory(options, &grpc_cache);
    if (!made.ok()) return made;
    *worker_cache = new RdmaWorkerCache(grpc_cache, calls_,
                                        TaskName(options.job_name, options.replica_index, options.task_index));
    return absl::OkStatus();
  }

 private:
  RdmaServer(const tensorflow::ServerDef& server_def, std::shared_ptr<Runtime> runtime)
      : GrpcServer(server_def, tensorflow::Env::Default()),
        runtime_(std::move(runtime)),
        calls_(std::make_shared<WorkerCalls>(runtime_)) {}

  absl::Status Init(tensorflow::DeviceMgr* local_device_mgr) {
    tensorflow::GrpcServerOptions options;
    options.local_device_mgr = local_device_mgr;
    options.rendezvous_mgr_func = [runtime = runtime_](const tensorflow::WorkerEnv* env) {
      return new RdmaRendezvousMgr(env, runtime);
    };
    options.collective_mgr_func = [runtime = runtime_](const tensorflow::ConfigProto& config,
                                                       const tensorflow::WorkerEnv* env,
                                                       tensorflow::WorkerCacheInterface* worker_cache) {
      return NewRdmaCollectiveExecutorMgr(config, env->device_mgr, worker_cache, runtime->local_task(), runtime)
          .release();
    };
    absl::Status initialized = GrpcServer::Init(options);
    if (!initialized.ok()) return initialized;
    eager_ = std::make_shared<EagerCalls>(
        worker_env(), runtime_, [this](tensorflow::core::RefCountPtr<tensorflow::eager::EagerClient>* client) {
          std::unique_ptr<tensorflow::eager::EagerClientCache> clients;
          absl::Status found = master_env()->worker_cache->GetEagerClientCache(&clients);
          return found.ok() ? clients->GetClient(runtime_->local_task(), client) : found;
        });
    calls_->Serve(
        worker_impl(), [eager = eager_](std::shared_ptr<ServedCall> call) { eager->Serve(call); },
        worker_env()->compute_pool);
    return absl::OkStatus();
  }

  const std::shared_ptr<Runtime> runtime_;
  // Worker-service and eager-service calls between this task and its peers (cc/tf/calls/).
  const std::shared_ptr<WorkerCalls> calls_;
  std::shared_ptr<EagerCalls> eager_;  // set once by Init
};

class RdmaServerFactory : public tensorflow::ServerFactory {
 public:
  bool AcceptsOptions(const tensorflow::ServerDef& server_def) override { return server_def.protocol() == kProtocol; }

  absl::Status NewServer(const tensorflow::ServerDef& server_def, const Options& options,
                         std::unique_ptr<tensorflow::ServerInterface>* out_server) override {
    return RdmaServer::Create(server_def, options.local_device_mgr, out_server);
  }
};

const bool registered = [] {
  tensorflow::ServerFactory::Register("TF_RDMA_SERVER", new RdmaServerFactory());
  return true;
}();

}  // namespace

void SetAddressOverrides(AddressOverrides overrides) {
  std::lock_guard<std::mutex> lock(overrides_mu);
  Overrides() = std::move(overrides);
}

absl::StatusOr<std::vector<TaskAddress>> TasksOf(const tensorflow::ClusterDef& cluster, const Config& config,
                                                 const AddressOverrides& overrides) {
  std::vector<TaskAddress> tasks;
  for (const tensorflow::JobDef& job : cluster.job()) {
    // In index order: a protobuf map iterates in no fixed order.
    const std::map<int, std::string> by_index(job.tasks().begin(), job.tasks().end());
    for (const auto& [index, address] : by_index) {
      TaskAddress task;
      task.task = TaskName(job.name(), 0, index);
      absl::StatusOr<Endpoint> endpoint = Endpoint::Parse(address);
      if (!endpoint.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("task ", task.task, " has address '", address, "', not host:port"));
      }
      task.host = endpoint->host;
      task.grpc_port = endpoint->port;
      auto override_it = overrides.find(task.task);
      if (override_it != overrides.end()) {
        absl::StatusOr<Endpoint> rdma = Endpoint::Parse(override_it->second);
        if (!rdma.ok() || rdma->host != task.host) {
          return absl::InvalidArgumentError(absl::StrCat("rdma_addresses['", task.task, "'] is '", override_it->second,
                                                         "'; it must be host:port on the task's host ", task.host));
        }
        task.rdma_port = rdma->port;
      } else if (task.grpc_port != 0) {
        const int port = task.grpc_port + config.port_offset;
        if (port <= 0 || port >= 65536) {
          return absl::InvalidArgumentError(absl::StrCat(
              "task ", task.task, ": port ", task.grpc_port, " + TF_RDMA_PORT_OFFSET ", config.port_offset, " is ",
              port, ", not a port; choose another TF_RDMA_PORT_OFFSET"));
        }
        task.rdma_port = static_cast<uint16_t>(port);
      }
      tasks.push_back(task);
    }
  }
  return tasks;
}

}  // namespace tf_rdma
