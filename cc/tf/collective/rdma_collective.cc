#include "cc/tf/collective/rdma_collective.h"

#include <cstring>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/tf/profiling/trace_span.h"
#include "cc/tf/runtime/task_names.h"
#include "tensorflow/core/common_runtime/base_collective_executor.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/distributed_runtime/collective_param_resolver_distributed.h"
#include "tensorflow/core/distributed_runtime/collective_rma_distributed.h"
#include "tensorflow/core/distributed_runtime/device_resolver_distributed.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/device_name_utils.h"

namespace tf_rdma {
namespace {

using tensorflow::StatusCallback;

bool IsCpuDeviceName(const std::string& device) {
  tensorflow::DeviceNameUtils::ParsedName parsed;
  return tensorflow::DeviceNameUtils::ParseFullName(device, &parsed) && parsed.type == "CPU";
}

// One buffer being received: its grant, until it lands, fails or the collective aborts.
struct PendingReceive {
  std::shared_ptr<Connection> connection;
  Tag tag;
  uint64_t grant = 0;  // 0 until granted
  bool cancelled = false;
};

// What outlives the remote access object: completions may arrive after TensorFlow dropped it.
struct CollectiveTransfers {
  std::shared_ptr<Runtime> runtime;
  std::shared_ptr<tensorflow::UnboundedWorkQueue> work_queue;
  std::mutex mu;
  absl::Status aborted;
  std::set<std::shared_ptr<PendingReceive>> pending;

  absl::Status Failed(const char* what, const std::string& peer_task, const absl::Status& cause) {
    runtime->stats().Peer(peer_task, [](PeerStats& s) { s.errors++; });
    return TaskFailure(what, peer_task, cause);
  }

  // TensorFlow's collectives may reduce or start their next step inline in `done`: never on the
  // transport's threads, which must keep moving other bytes meanwhile.
  void Complete(const StatusCallback& done, const absl::Status& status) {
    work_queue->Schedule([done, status] { done(status); });
  }

  void Cancel(const std::shared_ptr<PendingReceive>& receive) {
    uint64_t grant;
    {
      std::lock_guard<std::mutex> lock(mu);
      receive->cancelled = true;
      grant = receive->grant;
    }
    if (grant != 0) receive->connection->Revoke(grant);
    receive->connection->DiscardPeerWrites(receive->tag);
  }

  void Forget(const std::shared_ptr<PendingReceive>& receive) {
    std::lock_guard<std::mutex> lock(mu);
    pending.erase(receive);
  }
};

class RdmaCollectiveRemoteAccess : public tensorflow::CollectiveRemoteAccessDistributed {
 public:
  RdmaCollectiveRemoteAccess(const tensorflow::DeviceMgr* dev_mgr,
                             tensorflow::DeviceResolverInterface* dev_resolver,
                             std::shared_ptr<tensorflow::UnboundedWorkQueue> work_queue,
                             tensorflow::WorkerCacheInterface* worker_cache, int64_t step_id,
                             std::string task_name, std::shared_ptr<Runtime> runtime)
      : CollectiveRemoteAccessDistributed(dev_mgr, dev_resolver, work_queue, worker_cache, step_id,
                                          std::move(task_name)),
        transfers_(std::make_shared<CollectiveTransfers>()) {
    transfers_->runtime = std::move(runtime);
    transfers_->work_queue = work_queue_;
  }

  void PostToPeer(const std::string& peer_device, const std::string& peer_task, const std::string& key,
                  tensorflow::Device* from_device, tensorflow::DeviceContext* from_device_ctx,
                  const tensorflow::AllocatorAttributes& from_alloc_attr, const tensorflow::Tensor* from_tensor,
                  const tensorflow::DeviceLocality& client_locality,
                  tsl::CancellationManager* cancellation_manager, const StatusCallback& done) override {
    if (peer_task == task_name_ || !Carried(from_device, peer_device)) {
      CollectiveRemoteAccessDistributed::PostToPeer(peer_device, peer_task, key, from_device, from_device_ctx,
                                                    from_alloc_attr, from_tensor, client_locality,
                                                    cancellation_manager, done);
      return;
    }
    const Tag tag = CollectiveTag(key, step_id_, from_device->name(), peer_device);
    const tensorflow::Tensor value = *from_tensor;  // shares the buffer: kept until the write completes
    Connections& connections = transfers_->runtime->connections();
    connections.WithConnection(peer_task, [transfers = transfers_, peer_task, tag, value, done,
                                           span = TraceSpan::Start(), step_id = step_id_](
                                              absl::StatusOr<std::shared_ptr<Connection>> connection) {
      if (!connection.ok()) {
        return transfers->Complete(done, transfers->Failed("sending a collective buffer to", peer_task,
                                                           connection.status()));
      }
      const uint64_t bytes = value.TotalBytes();
      (*connection)->Write(tag, value.tensor_data().data(), bytes,
                           [transfers, peer_task, value, done, span, step_id,
                            backend = (*connection)->backend()](const absl::Status& s) mutable {
                             span.End([&] {
                               return TransferEvent("tf_rdma collective send", peer_task, BackendName(backend),
                                                    value.TotalBytes(), step_id, s);
                             });
                             transfers->Complete(done, s.ok() ? s : transfers->Failed("sending a collective buffer to", peer_task, s));
                           });
      transfers->runtime->stats().Peer(peer_task, [bytes](PeerStats& s) {
        s.tensors_sent++;
        s.bytes_sent += bytes;
        s.bytes_sent_by_kind[kKindCollective] += bytes;
      });
    });
  }

  void RecvFromPeer(const std::string& peer_device, const std::string& peer_task, bool peer_is_local,
                    const std::string& key, tensorflow::Device* to_device,
                    tensorflow::DeviceContext* to_device_ctx, const tensorflow::AllocatorAttributes& to_alloc_attr,
                    tensorflow::Tensor* to_tensor, const tensorflow::DeviceLocality& client_locality,
                    int dev_to_dev_stream_index, tsl::CancellationManager* cancellation_manager,
                    const StatusCallback& done) override {
    if (peer_is_local || !Carried(to_device, peer_device)) {
      CollectiveRemoteAccessDistributed::RecvFromPeer(peer_device, peer_task, peer_is_local, key, to_device,
                                                      to_device_ctx, to_alloc_attr, to_tensor, client_locality,
                                                      dev_to_dev_stream_index, cancellation_manager, done);
      return;
    }
    const Tag tag = CollectiveTag(key, step_id_, peer_device, to_device->name());
    Connections& connections = transfers_->runtime->connections();
    connections.WithConnection(peer_task, [transfers = transfers_, peer_task, tag, to_tensor, cancellation_manager, done,
                                           span = TraceSpan::Start(), step_id = step_id_](
                                              absl::StatusOr<std::shared_ptr<Connection>> connection) {
      if (!connection.ok()) {
        return transfers->Complete(done, transfers->Failed("receiving a collective buffer from", peer_task,
                                                           connection.status()));
      }
      Receive(transfers, *connection, peer_task, tag, to_tensor, cancellation_manager, span, step_id, done);
    });
  }

  void StartAbort(const absl::Status& status) override {
    CollectiveRemoteAccessDistributed::StartAbort(status);
    std::set<std::shared_ptr<PendingReceive>> pending;
    {
      std::lock_guard<std::mutex> lock(transfers_->mu);
      transfers_->aborted = status;
      pending = transfers_->pending;
    }
    for (const auto& receive : pending) transfers_->Cancel(receive);
  }

 private:
  static void Receive(const std::shared_ptr<CollectiveTransfers>& transfers,
                      const std::shared_ptr<Connection>& connection, const std::string& peer_task, const Tag& tag,
                      tensorflow::Tensor* to_tensor, tsl::CancellationManager* cancellation_manager,
                      TraceSpan span, int64_t step_id, const StatusCallback& done) {
    const uint64_t bytes = to_tensor->TotalBytes();
    absl::StatusOr<std::shared_ptr<BufferPool>> pool = transfers->runtime->receive_pools().For(connection);
    if (!pool.ok()) return transfers->Complete(done, pool.status());
    absl::StatusOr<std::unique_ptr<PoolBuffer>> allocated = (*pool)->Allocate(bytes);
    if (!allocated.ok()) return transfers->Complete(done, allocated.status());
    std::shared_ptr<PoolBuffer> buffer = std::move(*allocated);
    auto pending = std::make_shared<PendingReceive>();
    pending->connection = connection;
    pending->tag = tag;
    {
      std::lock_guard<std::mutex> lock(transfers->mu);
      if (!transfers->aborted.ok()) return transfers->Complete(done, transfers->aborted);
      transfers->pending.insert(pending);
    }
    tsl::CancellationToken token = tsl::CancellationManager::kInvalidToken;
    if (cancellation_manager != nullptr) {
      token = cancellation_manager->get_cancellation_token();
      if (!cancellation_manager->RegisterCallback(token, [transfers, pending] { transfers->Cancel(pending); })) {
        transfers->Forget(pending);
        return transfers->Complete(done, absl::CancelledError("the collective was cancelled"));
      }
    }
    // The buffer stays with the grant's callback until the grant completes: nothing else may use
    // it while the peer may still write it.
    const uint64_t grant = connection->Grant(
        tag, buffer->region(), buffer->offset(), bytes,
        [transfers, pending, buffer, bytes, to_tensor, peer_task, cancellation_manager, token, done, span, step_id,
         backend = connection->backend()](const GrantResult& r) mutable {
          if (cancellation_manager != nullptr) cancellation_manager->TryDeregisterCallback(token);
          transfers->Forget(pending);
          absl::Status status = r.status;
          if (status.code() == absl::StatusCode::kResourceExhausted) {
            status = absl::DataLossError(
                absl::StrCat("the peer sent ", r.length, " bytes where the collective expects ", bytes));
          }
          if (status.ok()) {
            std::memcpy(const_cast<char*>(to_tensor->tensor_data().data()), buffer->data(), bytes);
            transfers->runtime->stats().Peer(peer_task, [bytes](PeerStats& s) {
              s.tensors_received++;
              s.bytes_received += bytes;
              s.bytes_received_by_kind[kKindCollective] += bytes;
            });
          } else if (!absl::IsCancelled(status)) {
            status = transfers->Failed("receiving a collective buffer from", peer_task, status);
          }
          span.End([&] {
            return TransferEvent("tf_rdma collective receive", peer_task, BackendName(backend), bytes, step_id, status);
          });
          transfers->Complete(done, status);
        });
    transfers->runtime->stats().Peer(peer_task, [](PeerStats& s) { s.grants++; });
    bool cancelled;
    {
      std::lock_guard<std::mutex> lock(transfers->mu);
      pending->grant = grant;
      cancelled = pending->cancelled;
    }
    if (cancelled) connection->Revoke(grant);  // cancelled while the grant was being made
  }

  bool Carried(tensorflow::Device* local_device, const std::string& peer_device) {
    if (local_device->device_type() == "CPU" && IsCpuDeviceName(peer_device)) return true;
    transfers_->runtime->stats().Fallback("a GPU end of a collective (gRPC copies device memory)");
    return false;
  }

  const std::shared_ptr<CollectiveTransfers> transfers_;
};

class RdmaCollectiveExecutorMgr : public tensorflow::RpcCollectiveExecutorMgr {
 public:
  RdmaCollectiveExecutorMgr(const tensorflow::ConfigProto& config, const tensorflow::DeviceMgr* device_mgr,
                            std::unique_ptr<tensorflow::DeviceResolverDistributed> dev_resolver,
                            std::unique_ptr<tensorflow::CollectiveParamResolverDistributed> param_resolver,
                            tensorflow::WorkerCacheInterface* worker_cache, const std::string& task_name,
                            std::shared_ptr<Runtime> runtime)
      : RpcCollectiveExecutorMgr(config, device_mgr, std::move(dev_resolver), std::move(param_resolver),
                                 /*nccl_communicator=*/nullptr, worker_cache, task_name),
        runtime_(std::move(runtime)) {}

 protected:
  tensorflow::CollectiveExecutor* Create(int64_t step_id) override {
    auto* remote_access = new RdmaCollectiveRemoteAccess(dev_mgr_, dev_resolver_.get(), work_queue_, worker_cache_,
                                                         step_id, task_name_, runtime_);
    return new tensorflow::BaseCollectiveExecutor(this, remote_access, step_id, dev_mgr_, work_queue_);
  }

 private:
  const std::shared_ptr<Runtime> runtime_;
};

}  // namespace

std::unique_ptr<tensorflow::RpcCollectiveExecutorMgr> NewRdmaCollectiveExecutorMgr(
    const tensorflow::ConfigProto& config, const tensorflow::DeviceMgr* device_mgr,
    tensorflow::WorkerCacheInterface* worker_cache, const std::string& task_name,
    std::shared_ptr<Runtime> runtime) {
  auto dev_resolver = std::make_unique<tensorflow::DeviceResolverDistributed>(device_mgr);
  auto param_resolver = std::make_unique<tensorflow::CollectiveParamResolverDistributed>(
      config, device_mgr, dev_resolver.get(), /*nccl_communicator=*/nullptr, worker_cache, task_name);
  return std::make_unique<RdmaCollectiveExecutorMgr>(config, device_mgr, std::move(dev_resolver),
                                                     std::move(param_resolver), worker_cache, task_name,
                                                     std::move(runtime));
}

}  // namespace tf_rdma
