// The control calls of one tf_rdma server, on the connections its runtime keeps with the other
// tasks (cc/tf/calls/call_channel.h): worker-service calls served from every peer to this task's
// own worker and eager-service calls to its eager service (eager_calls.h), and both made to peers
// for the worker cache and its eager clients (rdma_worker_cache.h, rdma_eager_client.h). Each
// request and reply is the call's protocol buffer, as gRPC carries it.
#ifndef TF_RDMA_CC_TF_CALLS_WORKER_CALLS_H_
#define TF_RDMA_CC_TF_CALLS_WORKER_CALLS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/tf/calls/call_channel.h"
#include "cc/tf/calls/call_methods.h"
#include "cc/tf/runtime/runtime.h"
#include "absl/time/time.h"
#include "tensorflow/core/distributed_runtime/call_options.h"
#include "tensorflow/core/distributed_runtime/worker_interface.h"
#include "tensorflow/core/platform/threadpool.h"
#include "google/protobuf/message.h"

namespace tf_rdma {

// Why calls stay on gRPC, as stats()['fallback'] counts them.
extern const char kRenamedTaskCall[];

class WorkerCalls : public std::enable_shared_from_this<WorkerCalls> {
 public:
  explicit WorkerCalls(std::shared_ptr<Runtime> runtime);

  // Serves peers' calls, each on a thread of `pool`, from every connection the runtime holds or
  // takes later: worker-service calls with `worker`, eager-service calls with `eager`. Before
  // this, a connection has no call server, and a peer's calls wait for it.
  using ServeEager = std::function<void(std::shared_ptr<ServedCall> call)>;
  void Serve(tensorflow::WorkerInterface* worker, ServeEager eager, tensorflow::thread::ThreadPool* pool);

  using Done = std::function<void(const absl::Status& status, std::string_view reply)>;
  // Calls `method` of `task`'s worker with `request` (its protocol buffer, serialized). `opts`, if
  // given, may cancel the call, and its timeout ends it with kDeadlineExceeded; it must outlive
  // the call. `done` runs once.
  void Call(const std::string& task, uint8_t method, std::string request, tensorflow::CallOptions* opts, Done done);
  // The same with the request and response as protocol buffers: `response` is filled before
  // `done` runs with OK.
  void CallProto(const std::string& task, uint8_t method, const google::protobuf::Message& request,
                 google::protobuf::Message* response, tensorflow::CallOptions* opts,
                 tensorflow::StatusCallback done);

  // CleanupGraph of step `step_id` on `task`'s worker, in one CleanupGraphs call with the other
  // steps' asked for within kCleanupWindow (up to kMaxCleanupSteps): TensorFlow's master asks
  // for one after each step and does not wait for it, so a step no longer costs a call of its own
  // for it. `done` runs once the task cleaned the step up, or with the call's error.
  static constexpr absl::Duration kCleanupWindow = absl::Milliseconds(1);
  void CleanupGraph(const std::string& task, int64_t step_id, tensorflow::StatusCallback done);

  // Whether calls from this task, named `local_target` by a cache's cluster, to `target` go on
  // tf_rdma: not to itself, nor between tasks a session renamed (counted in stats()['fallback']).
  bool Carries(const std::string& local_target, const std::string& target) const;

  const std::shared_ptr<Runtime>& runtime() const { return runtime_; }

 private:
  void StartServing(const std::shared_ptr<Connection>& connection);
  void Dispatch(std::shared_ptr<ServedCall> call);
  void CallOn(const std::shared_ptr<Connection>& connection, const std::string& task, uint8_t method,
              std::string request, tensorflow::CallOptions* opts, Done done);
  absl::StatusOr<std::shared_ptr<CallClient>> ClientFor(const std::string& task,
                                                       const std::shared_ptr<Connection>& connection);
  // Sends the steps CleanupGraph gathered for `task` so far, if any.
  void SendCleanups(const std::string& task);

  const std::shared_ptr<Runtime> runtime_;
  const CallLimits limits_;
  tensorflow::WorkerInterface* worker_ = nullptr;  // set once by Serve
  ServeEager eager_;
  tensorflow::thread::ThreadPool* pool_ = nullptr;
  std::mutex mu_;
  // The calling side of each peer's live connection; replaced with the connection.
  std::map<std::string, std::shared_ptr<CallClient>> clients_;
  struct Cleanups {
    std::vector<int64_t> step_ids;
    std::vector<tensorflow::StatusCallback> dones;
  };
  // The steps each task's next CleanupGraphs call cleans up.
  std::map<std::string, Cleanups> cleanups_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_WORKER_CALLS_H_
