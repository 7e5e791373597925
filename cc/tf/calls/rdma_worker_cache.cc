#include "cc/tf/calls/rdma_worker_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/tf/calls/rdma_eager_client.h"
#include "cc/tf/calls/run_graph_ids.h"
#include "tensorflow/core/protobuf/worker.pb.h"

namespace tf_rdma {
namespace {

using tensorflow::CallOptions;
using tensorflow::StatusCallback;
using tensorflow::WorkerInterface;

// Another task's worker, reached by calls on tf_rdma; gRPC's worker for the same task serves what
// tf_rdma leaves to gRPC.
class RdmaWorker : public WorkerInterface {
 public:
  RdmaWorker(std::string task, WorkerInterface* grpc, std::shared_ptr<WorkerCalls> calls)
      : task_(std::move(task)), grpc_(grpc), calls_(std::move(calls)) {}
  ~RdmaWorker() override = default;

  WorkerInterface* grpc() const { return grpc_; }

  // Device discovery, before a session or an eager context exists: gRPC's channel waits for a
  // task that starts later (fail_fast false) or fails at once (true), and a task whose tf_rdma
  // cannot connect (another secret, a wrong address) is still found, to fail its first step
  // naming why.
  void GetStatusAsync(CallOptions* opts, const tensorflow::GetStatusRequest* request,
                      tensorflow::GetStatusResponse* response, bool fail_fast, StatusCallback done) override {
    CountOnGrpc("GetStatus");
    grpc_->GetStatusAsync(opts, request, response, fail_fast, std::move(done));
  }
  void CreateWorkerSessionAsync(const tensorflow::CreateWorkerSessionRequest* request,
                                tensorflow::CreateWorkerSessionResponse* response, StatusCallback done) override {
    Forward(WorkerMethod::kCreateWorkerSession, &WorkerInterface::CreateWorkerSessionAsync, request, response,
            std::move(done));
  }
  void DeleteWorkerSessionAsync(CallOptions* opts, const tensorflow::DeleteWorkerSessionRequest* request,
                                tensorflow::DeleteWorkerSessionResponse* response, StatusCallback done) override {
    Forward(WorkerMethod::kDeleteWorkerSession, &WorkerInterface::DeleteWorkerSessionAsync, opts, request, response,
            std::move(done));
  }
  void RegisterGraphAsync(const tensorflow::RegisterGraphRequest* request, tensorflow::RegisterGraphResponse* response,
                          StatusCallback done) override {
    Forward(WorkerMethod::kRegisterGraph, &WorkerInterface::RegisterGraphAsync, request, response, std::move(done));
  }
  void DeregisterGraphAsync(const tensorflow::DeregisterGraphRequest* request,
                            tensorflow::DeregisterGraphResponse* response, StatusCallback done) override {
    Forward(WorkerMethod::kDeregisterGraph, &WorkerInterface::DeregisterGraphAsync, request, response,
            std::move(done));
  }
  tensorflow::MutableRunGraphRequestWrapper* CreateRunGraphRequest() override {
    return new RunGraphRequestWithOwnId<tensorflow::MutableProtoRunGraphRequest>;
  }
  // The response is proto-backed: the default CreateRunGraphResponse made it.
  void RunGraphAsync(CallOptions* opts, tensorflow::RunGraphRequestWrapper* request,
                     tensorflow::MutableRunGraphResponseWrapper* response, StatusCallback done) override {
    Call(WorkerMethod::kRunGraph, request->ToProto(), get_proto_from_wrapper(response), opts, std::move(done),
         [=](StatusCallback d) { grpc_->RunGraphAsync(opts, request, response, std::move(d)); });
  }
  // Gathered with other steps' into one call (WorkerCalls::CleanupGraph); the response is empty.
  void CleanupGraphAsync(const tensorflow::CleanupGraphRequest* request, tensorflow::CleanupGraphResponse* response,
                         StatusCallback done) override {
    if (RenamedCounted(WorkerMethod::kCleanupGraph)) {
      grpc_->CleanupGraphAsync(request, response, std::move(done));
      return;
    }
    calls_->CleanupGraph(task_, request->step_id(), std::move(done));
  }
  void CleanupAllAsync(const tensorflow::CleanupAllRequest* request, tensorflow::CleanupAllResponse* response,
                       StatusCallback done) override {
    Forward(WorkerMethod::kCleanupAll, &WorkerInterface::CleanupAllAsync, request, response, std::move(done));
  }
  void LoggingAsync(const tensorflow::LoggingRequest* request, tensorflow::LoggingResponse* response,
                    StatusCallback done) override {
    Forward(WorkerMethod::kLogging, &WorkerInterface::LoggingAsync, request, response, std::move(done));
  }
  void TracingAsync(const tensorflow::TracingRequest* request, tensorflow::TracingResponse* response,
                    StatusCallback done) override {
    Forward(WorkerMethod::kTracing, &WorkerInterface::TracingAsync, request, response, std::move(done));
  }
  void CompleteGroupAsync(CallOptions* opts, const tensorflow::CompleteGroupRequest* request,
                          tensorflow::CompleteGroupResponse* response, StatusCallback done) override {
    Forward(WorkerMethod::kCompleteGroup, &WorkerInterface::CompleteGroupAsync, opts, request, response,
            std::move(done));
  }
  void CompleteInstanceAsync(CallOptions* opts, const tensorflow::CompleteInstanceRequest* request,
                             tensorflow::CompleteInstanceResponse* response, StatusCallback done) override {
    Forward(WorkerMethod::kCompleteInstance, &WorkerInterface::CompleteInstanceAsync, opts, request, response,
            std::move(done));
  }
  void GetStepSequenceAsync(const tensorflow::GetStepSequenceRequest* request,
                            tensorflow::GetStepSequenceResponse* response, StatusCallback done) override {
    Forward(WorkerMethod::kGetStepSequence, &WorkerInterface::GetStepSequenceAsync, request, response,
            std::move(done));
  }
  // gRPC's rendezvous and collectives fetch over these only what tf_rdma does not carry.
  void RecvTensorAsync(CallOptions* opts, const tensorflow::RecvTensorRequest* request,
                       tensorflow::TensorResponse* response, StatusCallback done) override {
    CountOnGrpc("RecvTensor");
    grpc_->RecvTensorAsync(opts, request, response, std::move(done));
  }
  void RecvBufAsync(CallOptions* opts, const tensorflow::RecvBufRequest* request, tensorflow::RecvBufResponse* response,
                    StatusCallback done) override {
    CountOnGrpc("RecvBuf");
    grpc_->RecvBufAsync(opts, request, response, std::move(done));
  }

 private:
  // `method` on tf_rdma, falling back to gRPC's worker's `rpc` as Call says: a method without
  // CallOptions, and one with them.
  template <typename Request, typename Response>
  void Forward(WorkerMethod method, void (WorkerInterface::*rpc)(const Request*, Response*, StatusCallback),
               const Request* request, Response* response, StatusCallback done) {
    Call(method, *request, response, nullptr, std::move(done),
         [this, rpc, request, response](StatusCallback d) { (grpc_->*rpc)(request, response, std::move(d)); });
  }
  template <typename Request, typename Response>
  void Forward(WorkerMethod method,
               void (WorkerInterface::*rpc)(CallOptions*, const Request*, Response*, StatusCallback),
               CallOptions* opts, const Request* request, Response* response, StatusCallback done) {
    Call(method, *request, response, opts, std::move(done), [this, rpc, opts, request, response](StatusCallback d) {
      (grpc_->*rpc)(opts, request, response, std::move(d));
    });
  }

  // `grpc` makes the same call on gRPC's worker: for a task its session renamed, which tf_rdma does
  // not carry (known before, or found by this call's connecting, which it never got past).
  void Call(WorkerMethod method, const google::protobuf::Message& request, google::protobuf::Message* response,
            CallOptions* opts,
            StatusCallback done, std::function<void(StatusCallback)> grpc) {
    if (RenamedCounted(method)) {
      grpc(std::move(done));
      return;
    }
    calls_->CallProto(task_, static_cast<uint8_t>(method), request, response, opts,
                      [this, method, done = std::move(done), grpc = std::move(grpc)](const absl::Status& status) mutable {
                        if (!status.ok() && RenamedCounted(method)) return grpc(std::move(done));
                        done(status);
                      });
  }

  // Whether task_ is known renamed, counting the call that stays on gRPC for it.
  bool RenamedCounted(WorkerMethod method) const {
    const std::shared_ptr<Runtime>& runtime = calls_->runtime();
    if (!runtime->task_addresses().Renamed(task_)) return false;
    runtime->stats().Fallback(kRenamedTaskCall);
    CountOnGrpc(MethodName(method));
    return true;
  }

  void CountOnGrpc(const char* method) const {
    calls_->runtime()->stats().Peer(task_, [method](PeerStats& s) { s.calls_on_grpc[method]++; });
  }

  const std::string task_;
  WorkerInterface* const grpc_;
  const std::shared_ptr<WorkerCalls> calls_;
};

}  // namespace

RdmaWorkerCache::RdmaWorkerCache(tensorflow::WorkerCacheInterface* grpc, std::shared_ptr<WorkerCalls> calls,
                                 std::string local_target)
    : grpc_(grpc), calls_(std::move(calls)), local_target_(std::move(local_target)) {}

RdmaWorkerCache::~RdmaWorkerCache() = default;

void RdmaWorkerCache::ListWorkers(std::vector<std::string>* workers) const { grpc_->ListWorkers(workers); }

void RdmaWorkerCache::ListWorkersInJob(const std::string& job_name, std::vector<std::string>* workers) const {
  grpc_->ListWorkersInJob(job_name, workers);
}

WorkerInterface* RdmaWorkerCache::GetOrCreateWorker(const std::string& target) {
  WorkerInterface* grpc = grpc_->GetOrCreateWorker(target);
  if (grpc == nullptr) return nullptr;
  if (!calls_->Carries(local_target_, target)) return new WorkerWithOwnRunGraphIds(grpc);
  return new RdmaWorker(target, grpc, calls_);
}

void RdmaWorkerCache::ReleaseWorker(const std::string& target, WorkerInterface* worker) {
  // By type, not by target: a task may have been renamed since its worker was made.
  if (auto* rdma = dynamic_cast<RdmaWorker*>(worker)) {
    grpc_->ReleaseWorker(target, rdma->grpc());
    delete rdma;
  } else if (auto* own_ids = dynamic_cast<WorkerWithOwnRunGraphIds*>(worker)) {
    grpc_->ReleaseWorker(target, own_ids->worker());
    delete own_ids;
  } else {
    grpc_->ReleaseWorker(target, worker);
  }
}

bool RdmaWorkerCache::GetDeviceLocalityNonBlocking(const std::string& device, tensorflow::DeviceLocality* locality) {
  return grpc_->GetDeviceLocalityNonBlocking(device, locality);
}

void RdmaWorkerCache::GetDeviceLocalityAsync(const std::string& device, tensorflow::DeviceLocality* locality,
                                             StatusCallback done) {
  grpc_->GetDeviceLocalityAsync(device, locality, std::move(done));
}

absl::Status RdmaWorkerCache::GetEagerClientCache(
    std::unique_ptr<tensorflow::eager::EagerClientCache>* eager_client_cache) {
  std::unique_ptr<tensorflow::eager::EagerClientCache> grpc;
  absl::Status made = grpc_->GetEagerClientCache(&grpc);
  if (!made.ok()) return made;
  *eager_client_cache = std::make_unique<RdmaEagerClientCache>(std::move(grpc), calls_, local_target_);
  return absl::OkStatus();
}

absl::Status RdmaWorkerCache::GetCoordinationClientCache(
    std::unique_ptr<tsl::CoordinationClientCache>* coordination_client_cache) {
  return grpc_->GetCoordinationClientCache(coordination_client_cache);
}

void RdmaWorkerCache::SetLogging(bool active) { grpc_->SetLogging(active); }
void RdmaWorkerCache::ClearLogs() { grpc_->ClearLogs(); }
bool RdmaWorkerCache::RetrieveLogs(int64_t step_id, tensorflow::StepStats* ss) {
  return grpc_->RetrieveLogs(step_id, ss);
}

}  // namespace tf_rdma
