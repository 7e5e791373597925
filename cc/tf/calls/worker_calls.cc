#include "cc/tf/calls/worker_calls.h"

#include <algorithm>
#include <utility>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/calls/call_timer.h"
#include "cc/tf/calls/served_proto.h"
#include "cc/tf/messages/call_message.h"
#include "cc/tf/runtime/task_names.h"
#include "tensorflow/core/protobuf/worker.pb.h"

namespace tf_rdma {

const char kRenamedTaskCall[] = "a call to a task its session renamed";

namespace {

using tensorflow::CallOptions;
using tensorflow::StatusCallback;
using tensorflow::WorkerInterface;

// A method served as the worker's method `rpc`: one without CallOptions, and one with them.
template <typename Request, typename Response>
void ServeWith(const std::shared_ptr<ServedCall>& call, WorkerInterface* worker,
               void (WorkerInterface::*rpc)(const Request*, Response*, StatusCallback)) {
  ServeProto<Request, Response>(call, [worker, rpc](CallOptions*, const Request* request, Response* response,
                                                    StatusCallback done) {
    (worker->*rpc)(request, response, std::move(done));
  });
}

template <typename Request, typename Response>
void ServeWith(const std::shared_ptr<ServedCall>& call, WorkerInterface* worker,
               void (WorkerInterface::*rpc)(CallOptions*, const Request*, Response*, StatusCallback)) {
  ServeProto<Request, Response>(call, [worker, rpc](CallOptions* opts, const Request* request, Response* response,
                                                    StatusCallback done) {
    (worker->*rpc)(opts, request, response, std::move(done));
  });
}

// CleanupGraphs: each step cleaned up as the worker's CleanupGraph would, one reply for them all.
void ServeCleanups(const std::shared_ptr<ServedCall>& call, WorkerInterface* worker) {
  absl::StatusOr<std::vector<int64_t>> step_ids = DecodeCleanupSteps(call->request());
  if (!step_ids.ok()) return call->Reply(step_ids.status(), {});
  struct Batch {
    std::mutex mu;
    size_t left;
    absl::Status status;
    std::vector<tensorflow::CleanupGraphRequest> requests;
    std::vector<tensorflow::CleanupGraphResponse> responses;
  };
  auto batch = std::make_shared<Batch>();
  batch->left = step_ids->size();
  batch->requests.resize(step_ids->size());
  batch->responses.resize(step_ids->size());
  for (size_t i = 0; i < step_ids->size(); ++i) batch->requests[i].set_step_id((*step_ids)[i]);
  for (size_t i = 0; i < step_ids->size(); ++i) {
    worker->CleanupGraphAsync(&batch->requests[i], &batch->responses[i], [call, batch](const absl::Status& status) {
      absl::Status all;
      {
        std::lock_guard<std::mutex> lock(batch->mu);
        batch->status.Update(status);
        if (--batch->left > 0) return;
        all = batch->status;
      }
      call->Reply(all, {});
    });
  }
}

}  // namespace

const char* MethodName(uint8_t number) {
  switch (number) {
    case static_cast<uint8_t>(WorkerMethod::kGetStatus): return "GetStatus";
    case static_cast<uint8_t>(WorkerMethod::kCreateWorkerSession): return "CreateWorkerSession";
    case static_cast<uint8_t>(WorkerMethod::kDeleteWorkerSession): return "DeleteWorkerSession";
    case static_cast<uint8_t>(WorkerMethod::kRegisterGraph): return "RegisterGraph";
    case static_cast<uint8_t>(WorkerMethod::kDeregisterGraph): return "DeregisterGraph";
    case static_cast<uint8_t>(WorkerMethod::kRunGraph): return "RunGraph";
    case static_cast<uint8_t>(WorkerMethod::kCleanupGraph): return "CleanupGraph";
    case static_cast<uint8_t>(WorkerMethod::kCleanupAll): return "CleanupAll";
    case static_cast<uint8_t>(WorkerMethod::kLogging): return "Logging";
    case static_cast<uint8_t>(WorkerMethod::kTracing): return "Tracing";
    case static_cast<uint8_t>(WorkerMethod::kCompleteGroup): return "CompleteGroup";
    case static_cast<uint8_t>(WorkerMethod::kCompleteInstance): return "CompleteInstance";
    case static_cast<uint8_t>(WorkerMethod::kGetStepSequence): return "GetStepSequence";
    case static_cast<uint8_t>(WorkerMethod::kCleanupGraphs): return "CleanupGraphs";
    case static_cast<uint8_t>(EagerMethod::kCreateContext): return "CreateContext";
    case static_cast<uint8_t>(EagerMethod::kUpdateContext): return "UpdateContext";
    case static_cast<uint8_t>(EagerMethod::kEnqueue): return "Enqueue";
    case static_cast<uint8_t>(EagerMethod::kStreamingEnqueue): return "StreamingEnqueue";
    case static_cast<uint8_t>(EagerMethod::kWaitQueueDone): return "WaitQueueDone";
    case static_cast<uint8_t>(EagerMethod::kRunComponentFunction): return "RunComponentFunction";
    case static_cast<uint8_t>(EagerMethod::kKeepAlive): return "KeepAlive";
    case static_cast<uint8_t>(EagerMethod::kCloseContext): return "CloseContext";
  }
  return "unknown";
}

WorkerCalls::WorkerCalls(std::shared_ptr<Runtime> runtime)
    : runtime_(std::move(runtime)),
      limits_{runtime_->config().max_call_bytes, runtime_->config().max_calls_per_peer} {}

void WorkerCalls::Serve(tensorflow::WorkerInterface* worker, ServeEager eager, tensorflow::thread::ThreadPool* pool) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    worker_ = worker;
    eager_ = std::move(eager);
    pool_ = pool;
  }
  runtime_->connections().Observe(
      [calls = shared_from_this()](const std::shared_ptr<Connection>& connection) { calls->StartServing(connection); });
}

void WorkerCalls::StartServing(const std::shared_ptr<Connection>& connection) {
  absl::StatusOr<std::shared_ptr<BufferPool>> pool = runtime_->receive_pools().For(connection);
  absl::StatusOr<Transport*> transport =
      pool.ok() ? runtime_->transports().For(connection->backend()) : absl::StatusOr<Transport*>(pool.status());
  absl::Status started = transport.ok() ? CallServer::Start(connection, **transport, *pool, limits_,
                                                            [calls = shared_from_this()](std::shared_ptr<ServedCall> call) {
                                                              calls->pool_->Schedule(
                                                                  [calls, call] { calls->Dispatch(call); });
                                                            })
                                        : transport.status();
  if (!started.ok()) {
    // Its calls could never be answered: the peer learns why from the connection's end. Closed
    // from the timer's thread: closing runs the connection's callbacks, and the runtime's lock is
    // held here.
    LOG(ERROR) << "tf_rdma: cannot serve worker-service calls from " << connection->peer_name() << ": " << started;
    CallTimer::Process().At(absl::InfinitePast(), [connection, started] { connection->Close(started); });
  }
}

void WorkerCalls::Dispatch(std::shared_ptr<ServedCall> call) {
  const char* name = MethodName(call->method());
  runtime_->stats().Peer(call->peer_name(), [name](PeerStats& s) { s.calls_served[name]++; });
  if (IsEagerMethod(call->method())) return eager_(std::move(call));
  const auto method = static_cast<WorkerMethod>(call->method());
  WorkerInterface* worker = worker_;
  using namespace tensorflow;  // the request and response types
  switch (method) {
    case WorkerMethod::kGetStatus:
      return ServeProto<GetStatusRequest, GetStatusResponse>(call, [worker](auto* opts, auto* req, auto* resp, auto done) {
        worker->GetStatusAsync(opts, req, resp, /*fail_fast=*/true, std::move(done));
      });
    case WorkerMethod::kCreateWorkerSession:
      return ServeWith(call, worker, &WorkerInterface::CreateWorkerSessionAsync);
    case WorkerMethod::kDeleteWorkerSession:
      return ServeWith(call, worker, &WorkerInterface::DeleteWorkerSessionAsync);
    case WorkerMethod::kRegisterGraph:
      return ServeWith(call, worker, &WorkerInterface::RegisterGraphAsync);
    case WorkerMethod::kDeregisterGraph:
      return ServeWith(call, worker, &WorkerInterface::DeregisterGraphAsync);
    case WorkerMethod::kRunGraph:
      return ServeWith<RunGraphRequest, RunGraphResponse>(call, worker, &WorkerInterface::RunGraphAsync);
    case WorkerMethod::kCleanupGraph:
      return ServeWith(call, worker, &WorkerInterface::CleanupGraphAsync);
    case WorkerMethod::kCleanupAll:
      return ServeWith(call, worker, &WorkerInterface::CleanupAllAsync);
    case WorkerMethod::kLogging:
      return ServeWith(call, worker, &WorkerInterface::LoggingAsync);
    case WorkerMethod::kTracing:
      return ServeWith(call, worker, &WorkerInterface::TracingAsync);
    case WorkerMethod::kCompleteGroup:
      return ServeWith(call, worker, &WorkerInterface::CompleteGroupAsync);
    case WorkerMethod::kCompleteInstance:
      return ServeWith(call, worker, &WorkerInterface::CompleteInstanceAsync);
    case WorkerMethod::kGetStepSequence:
      return ServeWith(call, worker, &WorkerInterface::GetStepSequenceAsync);
    case WorkerMethod::kCleanupGraphs:
      return ServeCleanups(call, worker);
  }
  call->Reply(absl::UnimplementedError(absl::StrCat("tf_rdma: no method numbered ",
                                                    static_cast<int>(call->method()))),
              {});
}

bool WorkerCalls::Carries(const std::string& local_target, const std::string& target) const {
  if (target == local_target) return false;  // gRPC's cache answers with the in-process worker
  // A session that renamed this task (ClusterSpec propagation) names the others its own way too:
  // its calls stay on gRPC, as its tensors do (RdmaRemoteRendezvous).
  if (local_target != runtime_->local_task() || runtime_->task_addresses().Renamed(target)) {
    runtime_->stats().Fallback(kRenamedTaskCall);
    return false;
  }
  return true;
}

void WorkerCalls::CleanupGraph(const std::string& task, int64_t step_id, StatusCallback done) {
  bool first, full;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Cleanups& cleanups = cleanups_[task];
    first = cleanups.step_ids.empty();
    cleanups.step_ids.push_back(step_id);
    cleanups.dones.push_back(std::move(done));
    full = cleanups.step_ids.size() >= kMaxCleanupSteps;
  }
  if (full) {
    SendCleanups(task);
  } else if (first) {
    CallTimer::Process().At(absl::Now() + kCleanupWindow,
                            [calls = shared_from_this(), task] { calls->SendCleanups(task); });
  }
}

void WorkerCalls::SendCleanups(const std::string& task) {
  Cleanups cleanups;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cleanups_.find(task);
    if (it == cleanups_.end()) return;
    cleanups = std::move(it->second);
    cleanups_.erase(it);
  }
  Call(task, static_cast<uint8_t>(WorkerMethod::kCleanupGraphs), EncodeCleanupSteps(cleanups.step_ids), nullptr,
       [dones = std::move(cleanups.dones)](const absl::Status& status, std::string_view) {
         for (const StatusCallback& done : dones) done(status);
       });
}

void WorkerCalls::CallProto(const std::string& task, uint8_t method, const google::protobuf::Message& request,
                            google::protobuf::Message* response, CallOptions* opts, StatusCallback done) {
  std::string bytes;
  if (!request.SerializeToString(&bytes)) {
    done(absl::InternalError(absl::StrCat("tf_rdma: the ", MethodName(method), " request to ", task,
                                          " does not serialize")));
    return;
  }
  Call(task, method, std::move(bytes), opts,
       [task, method, response, done = std::move(done)](const absl::Status& status, std::string_view reply) {
         if (!status.ok()) return done(status);
         if (!response->ParseFromArray(reply.data(), static_cast<int>(reply.size()))) {
           return done(absl::DataLossError(
               absl::StrCat("tf_rdma: the ", MethodName(method), " reply from ", task, " does not parse")));
         }
         done(absl::OkStatus());
       });
}

void WorkerCalls::Call(const std::string& task, uint8_t method, std::string request, CallOptions* opts, Done done) {
  runtime_->connections().WithConnection(
      task,
      [calls = shared_from_this(), task, method, request = std::move(request), opts,
       done = std::move(done)](absl::StatusOr<std::shared_ptr<Connection>> connection) mutable {
        if (!connection.ok()) {
          // The code says why (a configuration error, a task without tf_rdma, one unreachable), as
          // a gRPC call that cannot reach its task fails at once.
          done(TaskFailure(absl::StrCat("the ", MethodName(method), " call to"), task, connection.status()), {});
          return;
        }
        calls->CallOn(*connection, task, method, std::move(request), opts, std::move(done));
      },
      Connections::Waiting::kAskPeerToDial);
}

void WorkerCalls::CallOn(const std::shared_ptr<Connection>& connection, const std::string& task, uint8_t method,
                         std::string request, CallOptions* opts, Done done) {
  absl::StatusOr<std::shared_ptr<CallClient>> client = ClientFor(task, connection);
  if (!client.ok()) {
    done(client.status(), {});
    return;
  }
  runtime_->stats().Peer(task, [method](PeerStats& s) { s.calls_made[MethodName(method)]++; });
  // What may end the call early (its deadline, its options' cancellation) may come before the call
  // exists: it is kept until then. After `done` nothing here touches `opts`: its owner may free it.
  struct Pending {
    std::mutex mu;
    bool made = false;
    std::weak_ptr<OutgoingCall> call;
    absl::Status early;
  };
  auto pending = std::make_shared<Pending>();
  auto end_early = [pending](const absl::Status& why) {
    std::shared_ptr<OutgoingCall> call;
    {
      std::lock_guard<std::mutex> lock(pending->mu);
      if (!pending->made) {
        if (pending->early.ok()) pending->early = why;
        return;
      }
      call = pending->call.lock();
    }
    if (call) call->Cancel(why);
  };
  const int64_t timeout_ms = opts != nullptr ? opts->GetTimeout() : 0;
  uint64_t deadline = 0;
  if (timeout_ms > 0) {
    deadline = CallTimer::Process().At(absl::Now() + absl::Milliseconds(timeout_ms), [end_early, task, method, timeout_ms] {
      end_early(absl::DeadlineExceededError(absl::StrCat("tf_rdma: the ", MethodName(method), " call to ", task,
                                                         " took longer than its ", timeout_ms, " ms")));
    });
  }
  if (opts != nullptr) {
    // StartCancel runs this under a lock that the call's completion takes (ClearCancelCallback):
    // the cancellation completes on the timer's thread.
    opts->SetCancelCallback([end_early] {
      CallTimer::Process().At(absl::InfinitePast(),
                              [end_early] { end_early(absl::CancelledError("tf_rdma: the call was cancelled")); });
    });
  }
  std::shared_ptr<OutgoingCall> call = (*client)->Call(
      method, std::move(request),
      [opts, deadline, connection, task, method, done = std::move(done)](const absl::Status& status,
                                                                        std::string_view reply) {
        // The timer's entry goes with the reply: at thousands of steps a second, deadlines of
        // minutes would pile up otherwise.
        if (deadline != 0) CallTimer::Process().Cancel(deadline);
        if (opts != nullptr) opts->ClearCancelCallback();
        // A call that ended with its connection names the task as gRPC's route does (which
        // ClusterCoordinator reads to tell a ps's failure from a worker's); an error the task
        // replied with is its own, passed on as it came.
        if (!status.ok() && !connection->health().ok()) {
          return done(TaskFailure(absl::StrCat("the ", MethodName(method), " call to"), task, status), reply);
        }
        done(status, reply);
      });
  absl::Status early;
  {
    std::lock_guard<std::mutex> lock(pending->mu);
    pending->made = true;
    pending->call = call;
    early = pending->early;
  }
  if (!early.ok()) call->Cancel(early);
}

absl::StatusOr<std::shared_ptr<CallClient>> WorkerCalls::ClientFor(const std::string& task,
                                                                   const std::shared_ptr<Connection>& connection) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<CallClient>& client = clients_[task];
  if (!client || client->connection() != connection) {
    absl::StatusOr<std::shared_ptr<BufferPool>> pool = runtime_->receive_pools().For(connection);
    if (!pool.ok()) return pool.status();
    client = std::make_shared<CallClient>(connection, *std::move(pool), limits_);
  }
  return client;
}

}  // namespace tf_rdma
