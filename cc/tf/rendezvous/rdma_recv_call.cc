#include "cc/tf/rendezvous/rdma_recv_call.h"

#include <utility>

#include "tensorflow/core/platform/env.h"

namespace tf_rdma {

using tensorflow::Tensor;

void RdmaRecvCall::Start(std::function<void()> recv_done) {
  std::shared_ptr<TensorReceive> receive =
      make_([this, recv_done](const absl::Status& status, const Tensor& tensor, bool dead) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (status_.ok()) status_ = status;
          tensor_ = tensor;
          dead_ = dead;
        }
        recv_done();
      });
  absl::Status aborted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    receive_ = receive;
    aborted = status_;
  }
  // Finishing runs the callback above, which takes mu_: never under it.
  if (!aborted.ok()) return receive->Finish(aborted);
  receive->Start();
}

void RdmaRecvCall::StartAbort(const absl::Status& status) {
  std::shared_ptr<TensorReceive> receive;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = status;
    receive = receive_;
  }
  if (receive) tensorflow::Env::Default()->SchedClosure([receive, status] { receive->Abort(status); });
}

absl::Status RdmaRecvCall::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

}  // namespace tf_rdma
