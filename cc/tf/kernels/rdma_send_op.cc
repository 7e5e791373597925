// RdmaSend: the "rdma" kernel of TensorFlow's _Send/_HostSend ops. Like TensorFlow's own Send it
// completes as soon as the tensor is handed over: the writes wait for the receiver's grants on the
// connection, holding a reference to the tensor (never a copy) until its bytes have left.
#include <memory>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/tf/kernels/transfer.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

class RdmaSendOp : public AsyncOpKernel {
 public:
  explicit RdmaSendOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    std::string send_device, recv_device;
    int64_t incarnation = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("send_device", &send_device));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("recv_device", &recv_device));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("send_device_incarnation", &incarnation));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    key_prefix_ = TransferKeyPrefix(send_device, static_cast<uint64_t>(incarnation), recv_device, tensor_name_);
    absl::StatusOr<std::string> peer = TaskOfDevice(recv_device);
    OP_REQUIRES_OK(ctx, peer.status());
    peer_task_ = *peer;
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Runtime* runtime = Runtime::Get();
    OP_REQUIRES_ASYNC(ctx, runtime != nullptr,
                      absl::FailedPreconditionError(
                          "a tf_rdma kernel runs in a process where tf_rdma is not started; start "
                          "every task of the cluster with tf_rdma.Server"),
                      done);
    const tensorflow::FrameAndIter frame_iter = ctx->frame_iter();
    const TransferTags tags = TagsFor(key_prefix_, ctx->step_id(), frame_iter.frame_id, frame_iter.iter_id);
    TensorHeader header;
    header.dead = ctx->is_input_dead();
    tensorflow::Tensor value;
    if (!header.dead) {
      value = ctx->input(0);
      header.dtype = value.dtype();
      header.shape = value.shape();
      header.data_bytes = value.TotalBytes();
    }
    auto encoded = std::make_shared<std::string>(EncodeHeader(header));
    runtime->WithConnection(peer_task_, [this, ctx, done = std::move(done), runtime, tags, encoded,
                                         value, dead = header.dead](
                                            absl::StatusOr<std::shared_ptr<Connection>> connection) {
      if (!connection.ok()) {
        ctx->SetStatus(absl::Status(connection.status().code(),
                                    absl::StrCat("tf_rdma: sending '", tensor_name_, "' to task ",
                                                 peer_task_, " failed: ", connection.status().message())));
        done();
        return;
      }
      Send(**connection, runtime, tags, encoded, value, dead);
      done();
    });
  }

 private:
  void Send(Connection& connection, Runtime* runtime, const TransferTags& tags,
            std::shared_ptr<std::string> header, const tensorflow::Tensor& value, bool dead) {
    // Failures here surface on the receiving side, whose step waits for these bytes; the sending
    // step, like TensorFlow's own Send, has already moved on.
    auto report = [runtime, peer = peer_task_, name = tensor_name_](const absl::Status& status) {
      if (status.ok()) return;
      LOG(WARNING) << "tf_rdma: sending '" << name << "' to task " << peer << " failed: " << status;
      runtime->stats().Peer(peer, [](PeerStats& s) { s.errors++; });
    };
    connection.Write(tags.header, header->data(), header->size(),
                     [header, report](const absl::Status& status) { report(status); });
    if (dead) return;
    const uint64_t bytes = value.TotalBytes();
    connection.Write(tags.data, value.tensor_data().data(), bytes,
                     [value, report](const absl::Status& status) { report(status); });
    runtime->stats().Peer(peer_task_, [bytes](PeerStats& s) {
      s.tensors_sent++;
      s.bytes_sent += bytes;
    });
  }

  std::string key_prefix_;
  std::string peer_task_;
  std::string tensor_name_;
};

REGISTER_KERNEL_BUILDER(Name("_Send").Device(tensorflow::DEVICE_CPU).Label("rdma"), RdmaSendOp);
REGISTER_KERNEL_BUILDER(Name("_HostSend").Device(tensorflow::DEVICE_CPU).Label("rdma"), RdmaSendOp);

}  // namespace
}  // namespace tf_rdma
