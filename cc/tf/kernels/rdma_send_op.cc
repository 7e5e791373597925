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
    absl::StatusOr<TransferIdentity> identity = ReadTransferIdentity(ctx, /*sending=*/true);
    OP_REQUIRES_OK(ctx, identity.status());
    identity_ = *std::move(identity);
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    absl::StatusOr<Runtime*> running = Runtime::ForKernels();
    OP_REQUIRES_OK_ASYNC(ctx, running.status(), done);
    Runtime* runtime = *running;
    const tensorflow::FrameAndIter frame_iter = ctx->frame_iter();
    const TransferTags tags = TagsFor(identity_.key_prefix, ctx->step_id(), frame_iter.frame_id, frame_iter.iter_id);
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
    runtime->WithConnection(identity_.peer_task, [this, ctx, done = std::move(done), runtime, tags, encoded,
                                         value, dead = header.dead](
                                            absl::StatusOr<std::shared_ptr<Connection>> connection) {
      if (!connection.ok()) {
        ctx->SetStatus(absl::Status(connection.status().code(),
                                    absl::StrCat("tf_rdma: sending '", identity_.tensor_name, "' to task ",
                                                 identity_.peer_task, " failed: ", connection.status().message())));
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
    auto report = [runtime, peer = identity_.peer_task, name = identity_.tensor_name](const absl::Status& status) {
      if (status.ok()) return;
      if (status == DiscardedWrite()) {
        // The receiver's step was cancelled and it discarded this transfer: nothing went wrong here.
        runtime->stats().Peer(peer, [](PeerStats& s) { s.sends_discarded++; });
        return;
      }
      LOG(WARNING) << "tf_rdma: sending '" << name << "' to task " << peer << " failed: " << status;
      runtime->stats().Peer(peer, [](PeerStats& s) { s.errors++; });
    };
    connection.Write(tags.header, header->data(), header->size(),
                     [header, report](const absl::Status& status) { report(status); });
    if (dead) return;
    const uint64_t bytes = value.TotalBytes();
    connection.Write(tags.data, value.tensor_data().data(), bytes,
                     [value, report](const absl::Status& status) { report(status); });
    runtime->stats().Peer(identity_.peer_task, [bytes](PeerStats& s) {
      s.tensors_sent++;
      s.bytes_sent += bytes;
    });
  }

  TransferIdentity identity_;
};

REGISTER_KERNEL_BUILDER(Name("_Send").Device(tensorflow::DEVICE_CPU).Label("rdma"), RdmaSendOp);
REGISTER_KERNEL_BUILDER(Name("_HostSend").Device(tensorflow::DEVICE_CPU).Label("rdma"), RdmaSendOp);

}  // namespace
}  // namespace tf_rdma
