// The eager clients a tf_rdma worker cache hands out (TF2: a coordinator's contexts on its workers,
// their operations and component functions): for a task that tf_rdma carries, a client whose calls
// travel as eager-service calls on tf_rdma (served by eager_calls.h); for the others, gRPC's.
//
// StreamingEnqueue keeps gRPC's stream order: one context's streamed requests reach the serving
// task one at a time, in order; those made while one is on its way go together as the next
// request, their items in order, and its response is split back among them. An error fails every
// request of the batch it came in, as an error ends gRPC's stream with the requests behind it.
// With TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE false (ParameterServerStrategy sets it), as in
// gRPC's client, each is a plain Enqueue that its caller waits for.
#ifndef TF_RDMA_CC_TF_CALLS_RDMA_EAGER_CLIENT_H_
#define TF_RDMA_CC_TF_CALLS_RDMA_EAGER_CLIENT_H_

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cc/tf/calls/worker_calls.h"
#include "tensorflow/core/distributed_runtime/eager/eager_client.h"

namespace tf_rdma {

class RdmaEagerClientCache : public tensorflow::eager::EagerClientCache {
 public:
  // `grpc` gives the clients of tasks that tf_rdma does not carry from `local_target` (the name
  // the worker cache's cluster gives this task).
  RdmaEagerClientCache(std::unique_ptr<tensorflow::eager::EagerClientCache> grpc, std::shared_ptr<WorkerCalls> calls,
                       std::string local_target);
  ~RdmaEagerClientCache() override;

  absl::Status GetClient(const std::string& target,
                         tensorflow::core::RefCountPtr<tensorflow::eager::EagerClient>* client) override;

 private:
  const std::unique_ptr<tensorflow::eager::EagerClientCache> grpc_;
  const std::shared_ptr<WorkerCalls> calls_;
  const std::string local_target_;
  std::mutex mu_;
  std::map<std::string, tensorflow::core::RefCountPtr<tensorflow::eager::EagerClient>> clients_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_RDMA_EAGER_CLIENT_H_
