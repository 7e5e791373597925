// RunGraph request ids that tell steps apart.
//
// A worker refuses a RunGraph whose request id it saw among the last 100,000 it served ("The same
// RunGraph (Worker) request was received twice", and the step fails with AbortedError): the id is
// how it spots a call the network delivered twice. TensorFlow's master draws the ids from
// GetUniqueRequestId(), a generator per thread seeded with 32 random bits, in a thread it starts for
// each step (Master::RunStep): every step's ids are one of 2^32 sequences, so once a worker has
// served 100,000 steps, about one step in 43,000 repeats the ids of one of them and fails, over
// gRPC as over tf_rdma. The workers tf_rdma's worker cache hands out put ids of tf_rdma's own in
// the requests they create instead: distinct within a process by construction, and 64 random bits
// apart from other processes' (a ps serves the masters of many workers).
#ifndef TF_RDMA_CC_TF_CALLS_RUN_GRAPH_IDS_H_
#define TF_RDMA_CC_TF_CALLS_RUN_GRAPH_IDS_H_

#include <cstdint>
#include <memory>

#include "tensorflow/core/distributed_runtime/message_wrappers.h"
#include "tensorflow/core/distributed_runtime/worker_interface.h"

namespace tf_rdma {

// The next id of this process's sequence; never 0 (which asks a worker not to check).
int64_t NextRunGraphRequestId();

// A RunGraph request of `Request`'s kind that takes the next id of NextRunGraphRequestId() for the
// one the master sets.
template <typename Request>
class RunGraphRequestWithOwnId final : public Request {
 public:
  void set_request_id(int64_t /*master's*/) override { Request::set_request_id(NextRunGraphRequestId()); }
};

// `worker` (gRPC's: this task's own, or another task's tf_rdma does not carry), except that the
// RunGraph requests it creates carry ids of NextRunGraphRequestId(): requests of the kind `worker`
// creates (in memory for this process's own worker, a proto for another task's), or `worker`'s own
// requests if it creates a kind this does not know.
class WorkerWithOwnRunGraphIds final : public tensorflow::WorkerInterface {
 public:
  explicit WorkerWithOwnRunGraphIds(tensorflow::WorkerInterface* worker);
  tensorflow::WorkerInterface* worker() const { return worker_; }

  tensorflow::MutableRunGraphRequestWrapper* CreateRunGraphRequest() override;
  tensorflow::MutableRunGraphResponseWrapper* CreateRunGraphResponse() override {
    return worker_->CreateRunGraphResponse();
  }
  void GetStatusAsync(tensorflow::CallOptions* opts, const tensorflow::GetStatusRequest* request,
                      tensorflow::GetStatusResponse* response, bool fail_fast,
                      tensorflow::StatusCallback done) override {
    worker_->GetStatusAsync(opts, request, response, fail_fast, std::move(done));
  }
  void CreateWorkerSessionAsync(const tensorflow::CreateWorkerSessionRequest* request,
                                tensorflow::CreateWorkerSessionResponse* response,
                                tensorflow::StatusCallback done) override {
    worker_->CreateWorkerSessionAsync(request, response, std::move(done));
  }
  void DeleteWorkerSessionAsync(tensorflow::CallOptions* opts, const tensorflow::DeleteWorkerSessionRequest* request,
                                tensorflow::DeleteWorkerSessionResponse* response,
                                tensorflow::StatusCallback done) override {
    worker_->DeleteWorkerSessionAsync(opts, request, response, std::move(done));
  }
  void RegisterGraphAsync(const tensorflow::RegisterGraphRequest* request, tensorflow::RegisterGraphResponse* response,
                          tensorflow::StatusCallback done) override {
    worker_->RegisterGraphAsync(request, response, std::move(done));
  }
  void DeregisterGraphAsync(const tensorflow::DeregisterGraphRequest* request,
                            tensorflow::DeregisterGraphResponse* response, tensorflow::StatusCallback done) override {
    worker_->DeregisterGraphAsync(request, response, std::move(done));
  }
  void RunGraphAsync(tensorflow::CallOptions* opts, tensorflow::RunGraphRequestWrapper* request,
                     tensorflow::MutableRunGraphResponseWrapper* response, tensorflow::StatusCallback done) override {
    worker_->RunGraphAsync(opts, request, response, std::move(done));
  }
  void RunGraphAsync(tensorflow::CallOptions* opts, const tensorflow::RunGraphRequest* request,
                     tensorflow::RunGraphResponse* response, tensorflow::StatusCallback done) override {
    worker_->RunGraphAsync(opts, request, response, std::move(done));
  }
  void CleanupGraphAsync(const tensorflow::CleanupGraphRequest* request, tensorflow::CleanupGraphResponse* response,
                         tensorflow::StatusCallback done) override {
    worker_->CleanupGraphAsync(request, response, std::move(done));
  }
  void CleanupAllAsync(const tensorflow::CleanupAllRequest* request, tensorflow::CleanupAllResponse* response,
                       tensorflow::StatusCallback done) override {
    worker_->CleanupAllAsync(request, response, std::move(done));
  }
  void RecvTensorAsync(tensorflow::CallOptions* opts, const tensorflow::RecvTensorRequest* request,
                       tensorflow::TensorResponse* response, tensorflow::StatusCallback done) override {
    worker_->RecvTensorAsync(opts, request, response, std::move(done));
  }
  void LoggingAsync(const tensorflow::LoggingRequest* request, tensorflow::LoggingResponse* response,
                    tensorflow::StatusCallback done) override {
    worker_->LoggingAsync(request, response, std::move(done));
  }
  void TracingAsync(const tensorflow::TracingRequest* request, tensorflow::TracingResponse* response,
                    tensorflow::StatusCallback done) override {
    worker_->TracingAsync(request, response, std::move(done));
  }
  void RecvBufAsync(tensorflow::CallOptions* opts, const tensorflow::RecvBufRequest* request,
                    tensorflow::RecvBufResponse* response, tensorflow::StatusCallback done) override {
    worker_->RecvBufAsync(opts, request, response, std::move(done));
  }
  void CompleteGroupAsync(tensorflow::CallOptions* opts, const tensorflow::CompleteGroupRequest* request,
                          tensorflow::CompleteGroupResponse* response, tensorflow::StatusCallback done) override {
    worker_->CompleteGroupAsync(opts, request, response, std::move(done));
  }
  void CompleteInstanceAsync(tensorflow::CallOptions* opts, const tensorflow::CompleteInstanceRequest* request,
                             tensorflow::CompleteInstanceResponse* response, tensorflow::StatusCallback done) override {
    worker_->CompleteInstanceAsync(opts, request, response, std::move(done));
  }
  void GetStepSequenceAsync(const tensorflow::GetStepSequenceRequest* request,
                            tensorflow::GetStepSequenceResponse* response, tensorflow::StatusCallback done) override {
    worker_->GetStepSequenceAsync(request, response, std::move(done));
  }

 private:
  enum class RequestKind { kInMemory, kProto, kUnknown };
  tensorflow::WorkerInterface* const worker_;
  const RequestKind kind_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_RUN_GRAPH_IDS_H_
