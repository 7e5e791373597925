// RdmaRecv: the "rdma" kernel of TensorFlow's _Recv/_HostRecv ops. Because the node stays a _Recv,
// the executor keeps treating it as a transfer node, so dead tensors in control flow propagate
// exactly as with TensorFlow's own transfers. The received tensor aliases the granted buffer
// (zero copy); the buffer returns to the pool when TensorFlow drops the tensor.
#include <atomic>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "cc/tf/kernels/transfer.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

// A tensor's storage that lives in a pool buffer of a registered region.
class PoolTensorBuffer : public tensorflow::TensorBuffer {
 public:
  PoolTensorBuffer(std::shared_ptr<PoolBuffer> buffer, size_t size)
      : TensorBuffer(buffer->data()), buffer_(std::move(buffer)), size_(size) {}
  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(size_);
    proto->set_allocator_name("tf_rdma");
  }
  bool OwnsMemory() const override { return false; }

 private:
  std::shared_ptr<PoolBuffer> buffer_;
  size_t size_;
};

class RdmaRecvOp : public AsyncOpKernel {
 public:
  explicit RdmaRecvOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_type", &dtype_));
    absl::StatusOr<TransferIdentity> identity = ReadTransferIdentity(ctx, /*sending=*/false);
    OP_REQUIRES_OK(ctx, identity.status());
    identity_ = *std::move(identity);
    int64_t planned = 0;
    if (tensorflow::TryGetNodeAttr(ctx->def(), kPlannedBytesAttr, &planned) && planned > 0) {
      expected_bytes.store(static_cast<uint64_t>(planned));
    }
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override;

  const std::string& peer_task() const { return identity_.peer_task; }
  const std::string& tensor_name() const { return identity_.tensor_name; }
  tensorflow::DataType dtype() const { return dtype_; }
  // The data grant's size: planned by the graph pass from static shapes, then what this edge
  // carried last time, so a steady shape needs one grant.
  std::atomic<uint64_t> expected_bytes{0};

 private:
  TransferIdentity identity_;
  tensorflow::DataType dtype_;
};

// One execution of the kernel: two grants (header, data) and the output they make.
class Receive : public std::enable_shared_from_this<Receive> {
 public:
  Receive(RdmaRecvOp* op, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done, Runtime* runtime,
          TransferTags tags)
      : op_(op), ctx_(ctx), done_(std::move(done)), runtime_(runtime), tags_(tags) {}

  void Start(std::shared_ptr<Connection> connection) {
    absl::StatusOr<BufferPool*> pool = runtime_->PoolFor(connection->backend());
    if (!pool.ok()) return Finish(pool.status());
    Locked lock(this);
    connection_ = std::move(connection);
    pool_ = *pool;
    tensorflow::CancellationManager* cm = ctx_->cancellation_manager();
    if (cm != nullptr) {
      token_ = cm->get_cancellation_token();
      if (!cm->RegisterCallback(token_, [self = shared_from_this()] { self->Cancel(); })) {
        token_ = tensorflow::CancellationManager::kInvalidToken;
        FinishLocked(absl::CancelledError("the step was cancelled"));
        return;
      }
    }
    absl::Status granted = GrantLocked(tags_.header, kHeaderCapacity, true);
    if (granted.ok()) granted = GrantLocked(tags_.data, op_->expected_bytes.load(), false);
    if (!granted.ok()) FinishLocked(granted);
  }

  void Finish(const absl::Status& status) {
    Locked lock(this);
    FinishLocked(status);
  }

 private:
  absl::Status GrantLocked(const Tag& tag, uint64_t capacity, bool is_header) {
    absl::StatusOr<std::unique_ptr<PoolBuffer>> allocated = pool_->Allocate(capacity);
    if (!allocated.ok()) return allocated.status();
    std::shared_ptr<PoolBuffer> buffer = std::move(*allocated);
    uint64_t& id = is_header ? header_grant_ : data_grant_;
    // The buffer stays with the grant's callback until the grant completes, whatever happens to
    // the kernel meanwhile: nothing else may use it while the peer may still write it.
    id = connection_->Grant(tag, buffer->region(), buffer->offset(), capacity,
                            [self = shared_from_this(), buffer, is_header](const GrantResult& r) {
                              if (is_header) {
                                self->OnHeader(r, *buffer);
                              } else {
                                self->OnData(r, buffer);
                              }
                            });
    runtime_->stats().Peer(op_->peer_task(), [](PeerStats& s) { s.grants++; });
    return absl::OkStatus();
  }

  void OnHeader(const GrantResult& result, const PoolBuffer& buffer) {
    Locked lock(this);
    if (finished_) return;
    if (!result.status.ok()) return FinishLocked(result.status);
    absl::StatusOr<TensorHeader> header = DecodeHeader(buffer.data(), result.length, op_->dtype());
    if (!header.ok()) return FinishLocked(header.status());
    header_ = *header;
    if (header_->dead) {
      // The sender writes no data for a dead tensor: take the data grant back.
      connection_->Revoke(data_grant_);
      runtime_->stats().Peer(op_->peer_task(), [](PeerStats& s) { s.dead_tensors++; });
      return FinishLocked(absl::OkStatus());
    }
    MaybeOutputLocked();
  }

  void OnData(const GrantResult& result, std::shared_ptr<PoolBuffer> buffer) {
    Locked lock(this);
    if (finished_) return;
    if (result.status.code() == absl::StatusCode::kResourceExhausted) {
      // The tensor outgrew what this edge carried before: grant what the sender says it needs.
      op_->expected_bytes.store(result.length);
      runtime_->stats().Peer(op_->peer_task(), [](PeerStats& s) { s.regrants++; });
      absl::Status granted = GrantLocked(tags_.data, result.length, false);
      if (!granted.ok()) FinishLocked(granted);
      return;
    }
    if (!result.status.ok()) return FinishLocked(result.status);
    data_ = std::move(buffer);
    data_length_ = result.length;
    MaybeOutputLocked();
  }

  void MaybeOutputLocked() {
    if (!header_ || !data_) return;
    if (header_->data_bytes != data_length_) {
      return FinishLocked(absl::DataLossError(absl::StrCat(
          "the header announced ", header_->data_bytes, " bytes but ", data_length_, " landed")));
    }
    op_->expected_bytes.store(data_length_);
    auto* storage = new PoolTensorBuffer(std::move(data_), data_length_);
    tensorflow::Tensor tensor(op_->dtype(), header_->shape, storage);
    storage->Unref();  // the tensor holds the only reference now
    ctx_->set_output(0, tensor);
    const uint64_t bytes = data_length_;
    runtime_->stats().Peer(op_->peer_task(), [bytes](PeerStats& s) {
      s.tensors_received++;
      s.bytes_received += bytes;
    });
    FinishLocked(absl::OkStatus());
  }

  void Cancel() {
    Locked lock(this);
    if (finished_) return;
    if (connection_) {
      connection_->Revoke(header_grant_);
      connection_->Revoke(data_grant_);
      // The sender's step may still send this transfer (or has, and waits for a grant): without
      // this its tensor would stay referenced until the connection closes.
      connection_->Discard(tags_.header);
      connection_->Discard(tags_.data);
    }
    FinishLocked(absl::CancelledError("the step was cancelled"));
  }

  void FinishLocked(const absl::Status& status) {
    if (finished_) return;
    finished_ = true;
    if (!status.ok()) {
      runtime_->stats().Peer(op_->peer_task(), [](PeerStats& s) { s.errors++; });
      ctx_->SetStatus(absl::Status(
          status.code(), absl::StrCat("tf_rdma: receiving '", op_->tensor_name(), "' from task ",
                                      op_->peer_task(), " failed: ", status.message())));
    }
    if (token_ != tensorflow::CancellationManager::kInvalidToken) {
      ctx_->cancellation_manager()->TryDeregisterCallback(token_);
    }
    // done_ runs when the outermost Locked lets go; after it the context is gone, and later grant
    // completions only release their buffers.
  }

  // Holds mu_; the outermost one on a thread runs done_ once the receive finished, unlocked:
  // TensorFlow may run downstream kernels inline in it, on the transport's thread.
  class Locked {
   public:
    explicit Locked(Receive* receive) : receive_(receive) {
      receive_->mu_.lock();
      ++receive_->lock_depth_;
    }
    ~Locked() {
      AsyncOpKernel::DoneCallback done;
      if (--receive_->lock_depth_ == 0 && receive_->finished_) std::swap(done, receive_->done_);
      receive_->mu_.unlock();
      if (done) done();
    }

   private:
    Receive* const receive_;
  };

  RdmaRecvOp* const op_;
  OpKernelContext* const ctx_;
  AsyncOpKernel::DoneCallback done_;
  Runtime* const runtime_;
  const TransferTags tags_;

  // Recursive: a grant on a connection that already failed completes inside Grant().
  std::recursive_mutex mu_;
  int lock_depth_ = 0;
  bool finished_ = false;
  std::shared_ptr<Connection> connection_;
  BufferPool* pool_ = nullptr;
  tensorflow::CancellationToken token_ = tensorflow::CancellationManager::kInvalidToken;
  uint64_t header_grant_ = 0;
  uint64_t data_grant_ = 0;
  std::optional<TensorHeader> header_;
  std::shared_ptr<PoolBuffer> data_;
  uint64_t data_length_ = 0;
};

void RdmaRecvOp::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  absl::StatusOr<Runtime*> running = Runtime::ForKernels();
  OP_REQUIRES_OK_ASYNC(ctx, running.status(), done);
  Runtime* runtime = *running;
  const tensorflow::FrameAndIter frame_iter = ctx->frame_iter();
  auto receive = std::make_shared<Receive>(
      this, ctx, std::move(done), runtime,
      TagsFor(identity_.key_prefix, ctx->step_id(), frame_iter.frame_id, frame_iter.iter_id));
  runtime->WithConnection(identity_.peer_task, [receive](absl::StatusOr<std::shared_ptr<Connection>> connection) {
    if (!connection.ok()) return receive->Finish(connection.status());
    receive->Start(std::move(*connection));
  });
}

REGISTER_KERNEL_BUILDER(Name("_Recv").Device(tensorflow::DEVICE_CPU).Label("rdma"), RdmaRecvOp);
REGISTER_KERNEL_BUILDER(Name("_HostRecv").Device(tensorflow::DEVICE_CPU).Label("rdma"), RdmaRecvOp);

}  // namespace
}  // namespace tf_rdma
