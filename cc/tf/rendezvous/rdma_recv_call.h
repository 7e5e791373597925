#ifndef TF_RDMA_CC_TF_RENDEZVOUS_RDMA_RECV_CALL_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_RDMA_RECV_CALL_H_

#include <functional>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "cc/tf/rendezvous/tensor_receive.h"
#include "tensorflow/core/distributed_runtime/base_rendezvous_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {

// A receive as the base rendezvous tracks it, so step aborts and cancellation reach it.
class RdmaRecvCall : public tensorflow::BaseRecvTensorCall {
 public:
  explicit RdmaRecvCall(std::function<std::shared_ptr<TensorReceive>(TensorReceive::Done)> make)
      : make_(std::move(make)) {}

  void Start(std::function<void()> recv_done) override;

  // Called under the rendezvous's locks: the receive finishes on another thread.
  void StartAbort(const absl::Status& status) override;

  absl::Status status() const override;
  const tensorflow::Tensor& tensor() const { return tensor_; }
  bool dead() const { return dead_; }

 private:
  const std::function<std::shared_ptr<TensorReceive>(TensorReceive::Done)> make_;
  mutable std::mutex mu_;
  absl::Status status_;
  std::shared_ptr<TensorReceive> receive_;
  tensorflow::Tensor tensor_;
  bool dead_ = false;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_RDMA_RECV_CALL_H_
