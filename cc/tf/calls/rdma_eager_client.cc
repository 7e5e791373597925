#include "cc/tf/calls/rdma_eager_client.h"

#include <strings.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <future>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/tf/calls/call_methods.h"
#include "cc/tf/calls/call_timer.h"
#include "tensorflow/core/protobuf/eager_service.pb.h"
#include "tensorflow/core/util/device_name_utils.h"

namespace tf_rdma {
namespace {

using tensorflow::CallOptions;
using tensorflow::StatusCallback;
using namespace tensorflow::eager;  // the request and response types

// TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE, read at each use as gRPC's client reads it:
// ParameterServerStrategy turns streaming off (one outstanding request per worker, which its
// failure handling and join rely on), tf.experimental.async_scope turns it on for a while.
bool StreamingEnabled() {
  const char* value = std::getenv("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE");
  return value == nullptr || !(strcasecmp(value, "false") == 0 || std::strcmp(value, "0") == 0);
}

// A task's eager service, reached by calls on tf_rdma; gRPC's client of the same task serves what
// tf_rdma leaves to gRPC: a task the client's context renamed (ClusterSpec propagation), known
// before a call or found by its connecting (CreateContext, UpdateContext: the first calls).
class RdmaEagerClient : public EagerClient {
 public:
  RdmaEagerClient(std::string task, std::shared_ptr<WorkerCalls> calls, tensorflow::core::RefCountPtr<EagerClient> grpc)
      : task_(std::move(task)), calls_(std::move(calls)), grpc_(std::move(grpc)) {}

  void CreateContextAsync(const CreateContextRequest* request, CreateContextResponse* response,
                          StatusCallback done) override {
    CreateContextAsync(request, response, std::move(done), /*init_timeout_in_ms=*/0, /*retries=*/0);
  }
  void UpdateContextAsync(const UpdateContextRequest* request, UpdateContextResponse* response,
                          StatusCallback done) override {
    if (OnGrpc(EagerMethod::kUpdateContext)) return grpc_->UpdateContextAsync(request, response, std::move(done));
    auto kept = std::make_shared<const UpdateContextRequest>(*request);
    Call(EagerMethod::kUpdateContext, *kept, response, nullptr, std::move(done),
         [this, kept, response](StatusCallback done) { grpc_->UpdateContextAsync(kept.get(), response, std::move(done)); });
  }
  void WaitQueueDoneAsync(const WaitQueueDoneRequest* request, WaitQueueDoneResponse* response,
                          StatusCallback done) override {
    if (OnGrpc(EagerMethod::kWaitQueueDone)) return grpc_->WaitQueueDoneAsync(request, response, std::move(done));
    Call(EagerMethod::kWaitQueueDone, *request, response, nullptr, std::move(done));
  }
  void KeepAliveAsync(const KeepAliveRequest* request, KeepAliveResponse* response, StatusCallback done) override {
    if (OnGrpc(EagerMethod::kKeepAlive)) return grpc_->KeepAliveAsync(request, response, std::move(done));
    Call(EagerMethod::kKeepAlive, *request, response, nullptr, std::move(done));
  }
  void CloseContextAsync(const CloseContextRequest* request, CloseContextResponse* response,
                         StatusCallback done) override {
    if (OnGrpc(EagerMethod::kCloseContext)) return grpc_->CloseContextAsync(request, response, std::move(done));
    Call(EagerMethod::kCloseContext, *request, response, nullptr, std::move(done));
  }
  // A coordinator creates its contexts on tasks that may not serve yet: as gRPC does, an attempt
  // that finds the task unreachable is made again, up to `retries` times, each within
  // `init_timeout_in_ms` if it is positive.
  void CreateContextAsync(const CreateContextRequest* request, CreateContextResponse* response, StatusCallback done,
                          int64_t init_timeout_in_ms, int retries) override {
    if (OnGrpc(EagerMethod::kCreateContext)) {
      return grpc_->CreateContextAsync(request, response, std::move(done), init_timeout_in_ms, retries);
    }
    CreateContextAttempt(std::make_shared<const CreateContextRequest>(*request), response, std::move(done),
                         init_timeout_in_ms, std::max(retries, 0), 0);
  }
  void EnqueueAsync(CallOptions* opts, const EnqueueRequest* request, EnqueueResponse* response,
                    StatusCallback done) override {
    if (OnGrpc(EagerMethod::kEnqueue)) return grpc_->EnqueueAsync(opts, request, response, std::move(done));
    Call(EagerMethod::kEnqueue, *request, response, opts, std::move(done));
  }
  void RunComponentFunctionAsync(CallOptions* opts, const RunComponentFunctionRequest* request,
                                 RunComponentFunctionResponse* response, StatusCallback done) override {
    if (OnGrpc(EagerMethod::kRunComponentFunction)) {
      return grpc_->RunComponentFunctionAsync(opts, request, response, std::move(done));
    }
    Call(EagerMethod::kRunComponentFunction, *request, response, opts, std::move(done));
  }
  void StreamingEnqueueAsync(bool enable_streaming_enqueue, CallOptions* opts, const EnqueueRequest* request,
                             EnqueueResponse* response, StatusCallback done) override;
  // When streaming, the executor may send a context's next request before the last is answered:
  // they are ordered here (see the top of rdma_eager_client.h).
  bool allow_multiple_pending_requests() const override { return StreamingEnabled(); }

 private:
  // One streamed request waiting for its turn.
  struct Streamed {
    EnqueueRequest request;
    EnqueueResponse* response;
    StatusCallback done;
  };
  // A context's stream: whether a request is on its way, and those behind it.
  struct Stream {
    bool sending = false;
    std::vector<Streamed> waiting;
  };

  // `on_grpc`, if given, makes the same call on gRPC's client when this one finds the task renamed.
  void Call(EagerMethod method, const google::protobuf::Message& request, google::protobuf::Message* response,
            CallOptions* opts, StatusCallback done, std::function<void(StatusCallback)> on_grpc = nullptr) {
    Ref();  // the client lives until its calls end, as gRPC's does
    calls_->CallProto(task_, static_cast<uint8_t>(method), request, response, opts,
                      [this, method, done = std::move(done), on_grpc = std::move(on_grpc)](const absl::Status& status) {
                        if (!status.ok() && on_grpc && OnGrpc(method)) {
                          on_grpc(done);
                        } else {
                          done(status);
                        }
                        Unref();
                      });
  }

  // Whether task_ is known renamed, counting the call that goes on gRPC for it.
  bool OnGrpc(EagerMethod method) const {
    const std::shared_ptr<Runtime>& runtime = calls_->runtime();
    if (!runtime->task_addresses().Renamed(task_)) return false;
    runtime->stats().Fallback(kRenamedTaskCall);
    runtime->stats().Peer(task_, [method](PeerStats& s) { s.calls_on_grpc[MethodName(method)]++; });
    return true;
  }

  void CreateContextAttempt(std::shared_ptr<const CreateContextRequest> request, CreateContextResponse* response,
                            StatusCallback done, int64_t timeout_ms, int retries, int attempt);
  // Sends `batch` (a context's streamed requests, in order) as one request.
  void SendStreamed(uint64_t context_id, std::vector<Streamed> batch);

  const std::string task_;
  const std::shared_ptr<WorkerCalls> calls_;
  const tensorflow::core::RefCountPtr<EagerClient> grpc_;
  std::mutex mu_;
  std::map<uint64_t, Stream> streams_;  // by context id
};

void RdmaEagerClient::CreateContextAttempt(std::shared_ptr<const CreateContextRequest> request,
                                           CreateContextResponse* response, StatusCallback done, int64_t timeout_ms,
                                           int retries, int attempt) {
  std::shared_ptr<CallOptions> opts;
  if (timeout_ms > 0) {
    opts = std::make_shared<CallOptions>();
    opts->SetTimeout(timeout_ms);
  }
  Ref();
  calls_->CallProto(
      task_, static_cast<uint8_t>(EagerMethod::kCreateContext), *request, response, opts.get(),
      [this, request, response, done = std::move(done), timeout_ms, retries, attempt, opts](const absl::Status& status) {
        if (!status.ok() && OnGrpc(EagerMethod::kCreateContext)) {
          // The task's server answered under another name: the context is gRPC's to make.
          grpc_->CreateContextAsync(request.get(), response, [request, done](const absl::Status& s) { done(s); },
                                    timeout_ms, retries - attempt);
          Unref();
          return;
        }
        if (absl::IsUnavailable(status) && attempt < retries) {
          const absl::Duration backoff = std::min(absl::Milliseconds(100) * (1 << std::min(attempt, 5)), absl::Seconds(2));
          CallTimer::Process().At(absl::Now() + backoff, [this, request, response, done, timeout_ms, retries, attempt] {
            CreateContextAttempt(request, response, done, timeout_ms, retries, attempt + 1);
            Unref();
          });
          return;
        }
        done(status);
        Unref();
      });
}

void RdmaEagerClient::StreamingEnqueueAsync(bool enable_streaming_enqueue, CallOptions* opts,
                                            const EnqueueRequest* request, EnqueueResponse* response,
                                            StatusCallback done) {
  if (OnGrpc(EagerMethod::kStreamingEnqueue)) {
    return grpc_->StreamingEnqueueAsync(enable_streaming_enqueue, opts, request, response, std::move(done));
  }
  if (!enable_streaming_enqueue || !StreamingEnabled()) {
    // As gRPC's client: a plain Enqueue, waited for, so that the caller's next request follows it.
    std::promise<absl::Status> enqueued;
    EnqueueAsync(opts, request, response, [&enqueued](const absl::Status& status) { enqueued.set_value(status); });
    done(enqueued.get_future().get());
    return;
  }
  std::vector<Streamed> batch;
  batch.push_back(Streamed{*request, response, std::move(done)});
  {
    std::lock_guard<std::mutex> lock(mu_);
    Stream& stream = streams_[request->context_id()];
    if (stream.sending) {
      stream.waiting.push_back(std::move(batch.front()));
      return;
    }
    stream.sending = true;
  }
  SendStreamed(request->context_id(), std::move(batch));
}

void RdmaEagerClient::SendStreamed(uint64_t context_id, std::vector<Streamed> batch) {
  struct Sent {
    EnqueueRequest request;
    EnqueueResponse response;
    std::vector<Streamed> batch;
  };
  auto sent = std::make_shared<Sent>();
  sent->request.set_context_id(context_id);
  for (Streamed& streamed : batch) sent->request.mutable_queue()->MergeFrom(streamed.request.queue());
  sent->batch = std::move(batch);
  Ref();
  calls_->CallProto(
      task_, static_cast<uint8_t>(EagerMethod::kStreamingEnqueue), sent->request, &sent->response, nullptr,
      [this, context_id, sent](const absl::Status& status) {
        absl::Status outcome = status;
        if (outcome.ok() && sent->response.queue_response_size() != sent->request.queue_size()) {
          outcome = absl::DataLossError(absl::StrCat("tf_rdma: ", task_, " answered ", sent->request.queue_size(),
                                                     " streamed eager operations with ",
                                                     sent->response.queue_response_size(), " results"));
        }
        int next = 0;
        for (Streamed& streamed : sent->batch) {
          for (int i = 0; outcome.ok() && i < streamed.request.queue_size(); ++i) {
            streamed.response->add_queue_response()->Swap(sent->response.mutable_queue_response(next++));
          }
          streamed.done(outcome);
        }
        std::vector<Streamed> waiting;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto stream = streams_.find(context_id);
          waiting.swap(stream->second.waiting);
          if (waiting.empty()) streams_.erase(stream);
        }
        if (!waiting.empty()) SendStreamed(context_id, std::move(waiting));
        Unref();
      });
}

}  // namespace

RdmaEagerClientCache::RdmaEagerClientCache(std::unique_ptr<EagerClientCache> grpc, std::shared_ptr<WorkerCalls> calls,
                                           std::string local_target)
    : grpc_(std::move(grpc)), calls_(std::move(calls)), local_target_(std::move(local_target)) {}

RdmaEagerClientCache::~RdmaEagerClientCache() = default;

absl::Status RdmaEagerClientCache::GetClient(const std::string& target,
                                             tensorflow::core::RefCountPtr<EagerClient>* client) {
  // Targets are tasks or, from remote functions, devices of them.
  tensorflow::DeviceNameUtils::ParsedName parsed;
  if (!tensorflow::DeviceNameUtils::ParseFullName(target, &parsed) || !parsed.has_job || !parsed.has_task) {
    return grpc_->GetClient(target, client);
  }
  const std::string task = absl::StrCat("/job:", parsed.job, "/replica:", parsed.replica, "/task:", parsed.task);
  if (!calls_->Carries(local_target_, task)) return grpc_->GetClient(target, client);
  std::lock_guard<std::mutex> lock(mu_);
  tensorflow::core::RefCountPtr<EagerClient>& cached = clients_[target];
  if (!cached) {
    tensorflow::core::RefCountPtr<EagerClient> grpc;
    absl::Status found = grpc_->GetClient(target, &grpc);
    if (!found.ok()) return found;
    cached.reset(new RdmaEagerClient(task, calls_, std::move(grpc)));
  }
  cached->Ref();
  client->reset(cached.get());
  return absl::OkStatus();
}

}  // namespace tf_rdma
