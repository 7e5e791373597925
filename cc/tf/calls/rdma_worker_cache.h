// The worker cache a tf_rdma server hands its master, its collectives and its eager context: the
// one gRPC's server would, except that a worker of another task is reached by worker-service
// calls on tf_rdma (worker_calls.h), and its eager service by eager-service calls
// (rdma_eager_client.h). What tf_rdma leaves to gRPC stays there: a task its session
// renamed (counted in stats()['fallback']), and the tensor fetches gRPC's own rendezvous and
// collectives make (RecvTensor, RecvBuf) when tf_rdma does not carry a tensor (a GPU end). Every
// worker it hands out names RunGraph requests with ids of tf_rdma's own (run_graph_ids.h).
#ifndef TF_RDMA_CC_TF_CALLS_RDMA_WORKER_CACHE_H_
#define TF_RDMA_CC_TF_CALLS_RDMA_WORKER_CACHE_H_

#include <memory>
#include <string>
#include <vector>

#include "cc/tf/calls/worker_calls.h"
#include "tensorflow/core/distributed_runtime/worker_cache.h"

namespace tf_rdma {

class RdmaWorkerCache : public tensorflow::WorkerCacheInterface {
 public:
  // Takes `grpc`, gRPC's cache for the same cluster, in which this process's task is
  // `local_target` (the name the cache's cluster gives it: a session may give it another).
  RdmaWorkerCache(tensorflow::WorkerCacheInterface* grpc, std::shared_ptr<WorkerCalls> calls,
                  std::string local_target);
  ~RdmaWorkerCache() override;

  void ListWorkers(std::vector<std::string>* workers) const override;
  void ListWorkersInJob(const std::string& job_name, std::vector<std::string>* workers) const override;
  tensorflow::WorkerInterface* GetOrCreateWorker(const std::string& target) override;
  void ReleaseWorker(const std::string& target, tensorflow::WorkerInterface* worker) override;
  bool GetDeviceLocalityNonBlocking(const std::string& device, tensorflow::DeviceLocality* locality) override;
  void GetDeviceLocalityAsync(const std::string& device, tensorflow::DeviceLocality* locality,
                              tensorflow::StatusCallback done) override;
  absl::Status GetEagerClientCache(std::unique_ptr<tensorflow::eager::EagerClientCache>* eager_client_cache) override;
  absl::Status GetCoordinationClientCache(
      std::unique_ptr<tsl::CoordinationClientCache>* coordination_client_cache) override;
  void SetLogging(bool active) override;
  void ClearLogs() override;
  bool RetrieveLogs(int64_t step_id, tensorflow::StepStats* ss) override;

 private:
  const std::unique_ptr<tensorflow::WorkerCacheInterface> grpc_;
  const std::shared_ptr<WorkerCalls> calls_;
  const std::string local_target_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_RDMA_WORKER_CACHE_H_
