// The worker-service calls of one tf_rdma server, on the connections its runtime keeps with the
// other tasks (cc/tf/calls/call_channel.h): served from every peer to this task's own worker, and
// made to peers for the worker cache (rdma_worker_cache.h). Each request and reply is the call's
// protocol buffer, as gRPC carries it.
#ifndef TF_RDMA_CC_TF_CALLS_WORKER_CALLS_H_
#define TF_RDMA_CC_TF_CALLS_WORKER_CALLS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cc/tf/calls/call_channel.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/distributed_runtime/call_options.h"
#include "tensorflow/core/distributed_runtime/worker_interface.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tf_rdma {

// The worker service's methods, as calls name them.
enum class WorkerMethod : uint8_t {
  kGetStatus = 1,
  kCreateWorkerSession,
  kDeleteWorkerSession,
  kRegisterGraph,
  kDeregisterGraph,
  kRunGraph,
  kCleanupGraph,
  kCleanupAll,
  kLogging,
  kTracing,
  kCompleteGroup,
  kCompleteInstance,
  kGetStepSequence,
};
// Its name, as stats() counts calls by it ("RunGraph").
const char* WorkerMethodName(WorkerMethod method);

class WorkerCalls : public std::enable_shared_from_this<WorkerCalls> {
 public:
  explicit WorkerCalls(std::shared_ptr<Runtime> runtime);

  // Serves peers' calls with `worker`, each on a thread of `pool`, from every connection the
  // runtime holds or takes later. Before this, a connection has no call server, and a peer's
  // calls wait for it.
  void Serve(tensorflow::WorkerInterface* worker, tensorflow::thread::ThreadPool* pool);

  using Done = std::function<void(const absl::Status& status, std::string_view reply)>;
  // Calls `method` of `task`'s worker with `request` (its protocol buffer, serialized). `opts`, if
  // given, may cancel the call, and its timeout ends it with kDeadlineExceeded; it must outlive
  // the call. `done` runs once.
  void Call(const std::string& task, WorkerMethod method, std::string request, tensorflow::CallOptions* opts,
            Done done);

  const std::shared_ptr<Runtime>& runtime() const { return runtime_; }

 private:
  void StartServing(const std::shared_ptr<Connection>& connection);
  void Dispatch(std::shared_ptr<ServedCall> call);
  void CallOn(const std::shared_ptr<Connection>& connection, const std::string& task, WorkerMethod method,
              std::string request, tensorflow::CallOptions* opts, Done done);
  absl::StatusOr<std::shared_ptr<CallClient>> ClientFor(const std::string& task,
                                                       const std::shared_ptr<Connection>& connection);

  const std::shared_ptr<Runtime> runtime_;
  const CallLimits limits_;
  tensorflow::WorkerInterface* worker_ = nullptr;  // set once by Serve
  tensorflow::thread::ThreadPool* pool_ = nullptr;
  std::mutex mu_;
  // The calling side of each peer's live connection; replaced with the connection.
  std::map<std::string, std::shared_ptr<CallClient>> clients_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_WORKER_CALLS_H_
