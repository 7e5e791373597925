// The serving side of eager-service calls on tf_rdma (TF2: a coordinator's contexts on its workers,
// their enqueued operations and component functions): served by an eager service of tf_rdma's own,
// as gRPC's eager service serves them. TensorFlow's gRPC server keeps its eager service to itself,
// so a context created over gRPC (by a client that does not run tf_rdma) lives in gRPC's service:
// a call on tf_rdma naming such a context is forwarded to it, counted in stats()['fallback'].
#ifndef TF_RDMA_CC_TF_CALLS_EAGER_CALLS_H_
#define TF_RDMA_CC_TF_CALLS_EAGER_CALLS_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "cc/tf/calls/call_channel.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/distributed_runtime/eager/eager_client.h"
#include "tensorflow/core/distributed_runtime/worker_env.h"

namespace tensorflow {
class EagerContext;
namespace eager {
class EagerServiceImpl;
}
}

namespace tf_rdma {

class EagerCalls {
 public:
  // `own_grpc` gives gRPC's eager client of this task's own gRPC eager service.
  using OwnGrpcClient = std::function<absl::Status(tensorflow::core::RefCountPtr<tensorflow::eager::EagerClient>*)>;
  EagerCalls(tensorflow::WorkerEnv* env, std::shared_ptr<Runtime> runtime, OwnGrpcClient own_grpc);
  ~EagerCalls();

  // Serves an eager method's call; may block the calling thread, as gRPC's eager service blocks
  // its handler's.
  void Serve(const std::shared_ptr<ServedCall>& call);

  // The master's context of a client in this task, which its remote functions call back into
  // (GrpcServer::AddMasterEagerContextToEagerService).
  absl::Status AddMasterContext(uint64_t context_id, tensorflow::EagerContext* context);

 private:
  class Service;

  // Serves a call on a context: by tf_rdma's service if it holds the context, else forwarded by
  // `forward(grpc_client, opts, request, response, done)` to gRPC's.
  template <typename Request, typename Response, typename Local, typename Forward>
  void ServeOnContext(const std::shared_ptr<ServedCall>& call, Local local, Forward forward);

  // A context's method that the service answers at once: tf_rdma's `method`, or gRPC's `forward`.
  template <typename Request, typename Response>
  void ServeSync(const std::shared_ptr<ServedCall>& call,
                 absl::Status (tensorflow::eager::EagerServiceImpl::*method)(const Request*, Response*),
                 void (tensorflow::eager::EagerClient::*forward)(const Request*, Response*, tensorflow::StatusCallback));

  const std::unique_ptr<Service> service_;
  const std::shared_ptr<Runtime> runtime_;
  const OwnGrpcClient own_grpc_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_EAGER_CALLS_H_
