#include "cc/tf/calls/eager_calls.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/tf/calls/call_methods.h"
#include "cc/tf/calls/served_proto.h"
#include "tensorflow/core/distributed_runtime/eager/eager_service_impl.h"
#include "tensorflow/core/protobuf/eager_service.pb.h"

namespace tf_rdma {
namespace {

using tensorflow::CallOptions;
using tensorflow::StatusCallback;
using tensorflow::eager::EagerClient;

// Why an eager call stays on gRPC, as stats()['fallback'] counts it.
constexpr char kContextOfGrpc[] = "an eager-service call on a context gRPC's eager service holds";

}  // namespace

class EagerCalls::Service : public tensorflow::eager::EagerServiceImpl {
 public:
  using EagerServiceImpl::EagerServiceImpl;

  bool Holds(uint64_t context_id) {
    ServerContext* context = nullptr;
    if (!GetServerContext(context_id, &context).ok()) return false;
    context->Unref();
    return true;
  }
};

EagerCalls::EagerCalls(tensorflow::WorkerEnv* env, std::shared_ptr<Runtime> runtime, OwnGrpcClient own_grpc)
    : service_(std::make_unique<Service>(env)), runtime_(std::move(runtime)), own_grpc_(std::move(own_grpc)) {}

EagerCalls::~EagerCalls() = default;

absl::Status EagerCalls::AddMasterContext(uint64_t context_id, tensorflow::EagerContext* context) {
  return service_->CreateMasterContext(context_id, context);
}

template <typename Request, typename Response, typename Local, typename Forward>
void EagerCalls::ServeOnContext(const std::shared_ptr<ServedCall>& call, Local local, Forward forward) {
  ServeProto<Request, Response>(call, [this, local, forward](CallOptions* opts, const Request* request,
                                                             Response* response, StatusCallback done) {
    if (service_->Holds(request->context_id())) return local(opts, request, response, std::move(done));
    tensorflow::core::RefCountPtr<EagerClient> grpc;
    absl::Status found = own_grpc_(&grpc);
    if (!found.ok()) {
      return done(absl::Status(found.code(), absl::StrCat("tf_rdma: eager context ", request->context_id(),
                                                          " is not tf_rdma's, and gRPC's eager service of this task "
                                                          "cannot be reached: ",
                                                          found.message())));
    }
    runtime_->stats().Fallback(kContextOfGrpc);
    forward(grpc.get(), opts, request, response, std::move(done));
  });
}

template <typename Request, typename Response>
void EagerCalls::ServeSync(const std::shared_ptr<ServedCall>& call,
                           absl::Status (tensorflow::eager::EagerServiceImpl::*method)(const Request*, Response*),
                           void (EagerClient::*forward)(const Request*, Response*, StatusCallback)) {
  ServeOnContext<Request, Response>(
      call,
      [service = service_.get(), method](CallOptions*, const Request* request, Response* response,
                                         StatusCallback done) { done((service->*method)(request, response)); },
      [forward](EagerClient* grpc, CallOptions*, const Request* request, Response* response, StatusCallback done) {
        (grpc->*forward)(request, response, std::move(done));
      });
}

void EagerCalls::Serve(const std::shared_ptr<ServedCall>& call) {
  using namespace tensorflow::eager;  // the request and response types
  Service* service = service_.get();
  switch (static_cast<EagerMethod>(call->method())) {
    case EagerMethod::kCreateContext:
      return ServeProto<CreateContextRequest, CreateContextResponse>(
          call, [service](CallOptions*, const CreateContextRequest* request, CreateContextResponse* response,
                          StatusCallback done) { done(service->CreateContext(request, response)); });
    case EagerMethod::kUpdateContext:
      return ServeSync(call, &Service::UpdateContext, &EagerClient::UpdateContextAsync);
    case EagerMethod::kEnqueue:
      return ServeOnContext<EnqueueRequest, EnqueueResponse>(
          call,
          [service](CallOptions* opts, auto* request, auto* response, StatusCallback done) {
            done(service->Enqueue(opts, request, response));
          },
          [](EagerClient* grpc, CallOptions* opts, auto* request, auto* response, StatusCallback done) {
            grpc->EnqueueAsync(opts, request, response, std::move(done));
          });
    case EagerMethod::kStreamingEnqueue: {
      // A connection's stream runs on an executor of its own in each context, in the order its
      // requests came (the calling side sends one at a time: rdma_eager_client.h). Its operations
      // run after the reply, so nothing of the call may reach them: no CallOptions, as in gRPC.
      const uint64_t stream_id = call->connection_key();
      return ServeOnContext<EnqueueRequest, EnqueueResponse>(
          call,
          [service, stream_id](CallOptions*, auto* request, auto* response, StatusCallback done) {
            done(service->Enqueue(/*call_opts=*/nullptr, request, response, stream_id));
          },
          [](EagerClient* grpc, CallOptions* opts, auto* request, auto* response, StatusCallback done) {
            grpc->StreamingEnqueueAsync(/*enable_streaming_enqueue=*/true, opts, request, response, std::move(done));
          });
    }
    case EagerMethod::kWaitQueueDone:
      return ServeSync(call, &Service::WaitQueueDone, &EagerClient::WaitQueueDoneAsync);
    case EagerMethod::kRunComponentFunction:
      return ServeOnContext<RunComponentFunctionRequest, RunComponentFunctionResponse>(
          call,
          [service](CallOptions* opts, auto* request, auto* response, StatusCallback done) {
            service->RunComponentFunction(opts, request, response, std::move(done));
          },
          [](EagerClient* grpc, CallOptions* opts, auto* request, auto* response, StatusCallback done) {
            grpc->RunComponentFunctionAsync(opts, request, response, std::move(done));
          });
    case EagerMethod::kKeepAlive:
      return ServeSync(call, &Service::KeepAlive, &EagerClient::KeepAliveAsync);
    case EagerMethod::kCloseContext:
      return ServeSync(call, &Service::CloseContext, &EagerClient::CloseContextAsync);
  }
  call->Reply(absl::UnimplementedError(
                  absl::StrCat("tf_rdma: no eager-service method numbered ", static_cast<int>(call->method()))),
              {});
}

}  // namespace tf_rdma
