// How a served control call runs on a TensorFlow service: its request parsed from the call's
// bytes, the method run with options the call's cancellation reaches, the response serialized
// into the reply. Shared by the worker service's calls and the eager service's.
#ifndef TF_RDMA_CC_TF_CALLS_SERVED_PROTO_H_
#define TF_RDMA_CC_TF_CALLS_SERVED_PROTO_H_

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/tf/calls/call_channel.h"
#include "tensorflow/core/distributed_runtime/call_options.h"
#include "tensorflow/core/platform/status.h"

namespace tf_rdma {

// Runs `invoke(opts, request, response, done)` on the call's parsed request, and replies with the
// response once `done` runs.
template <typename Request, typename Response, typename Invoke>
void ServeProto(const std::shared_ptr<ServedCall>& call, Invoke invoke) {
  struct State {
    tensorflow::CallOptions opts;
    Request request;
    Response response;
  };
  auto state = std::make_shared<State>();
  if (!state->request.ParseFromString(call->request())) {
    call->Reply(absl::InvalidArgumentError(absl::StrCat("tf_rdma: a ", state->request.GetTypeName(),
                                                        " that does not parse")),
                {});
    return;
  }
  call->SetCancelCallback([state] { state->opts.StartCancel(); });
  invoke(&state->opts, &state->request, &state->response, [call, state](const absl::Status& status) {
    call->Reply(status, status.ok() ? state->response.SerializeAsString() : std::string());
  });
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_SERVED_PROTO_H_
