// The receive state machine: one tensor from a peer, through its header and data grants (or its
// slot of a fused message) to the tensor they make.
#ifndef TF_RDMA_CC_TF_RENDEZVOUS_TENSOR_RECEIVE_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_TENSOR_RECEIVE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/tf/planning/fusion.h"
#include "cc/tf/profiling/trace_span.h"
#include "cc/tf/rendezvous/fused_receive.h"
#include "cc/tf/runtime/buffer_pool.h"
#include "cc/tf/runtime/runtime.h"
#include "cc/transport/transport.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {

// One receive: the header and data grants, and the tensor they make.
class TensorReceive : public std::enable_shared_from_this<TensorReceive> {
 public:
  using Done = std::function<void(const absl::Status&, const tensorflow::Tensor&, bool is_dead)>;

  // A fused transfer's header message comes in its slot of `fused`, the step's fused message.
  struct FusedSlot {
    std::shared_ptr<FusedReceive> message;
    FusedMember member;
  };

  // `key` is the rendezvous key of the transfer.
  TensorReceive(std::shared_ptr<Runtime> runtime, std::string peer_task, std::string key, int64_t step_id,
                std::string tensor_name, std::optional<FusedSlot> fused, Done done)
      : runtime_(std::move(runtime)), peer_task_(std::move(peer_task)), key_(std::move(key)), step_id_(step_id),
        tensor_name_(std::move(tensor_name)), fused_(std::move(fused)), done_(std::move(done)) {}

  void Start();

  // The step ended without this tensor: FinishLocked gives the grants back and tells the sender
  // not to send. A receive that finished already did both.
  void Abort(const absl::Status& status);

  void Finish(const absl::Status& status);

 private:
  // Only a tensor with grants of its own needs its tags and its sizes learned (a fused member's
  // come planned in its slot): hashing them per fused tensor would cost more than the rest.
  void StartGrants();

  void OnFusedSlot(const absl::Status& status, std::string_view message);

  void Grant(std::shared_ptr<Connection> connection);

  // What this transfer carried last time; for its first crossing, what the static shapes planned.
  uint64_t FirstGrantBytes();

  absl::Status GrantLocked(const Tag& tag, uint64_t capacity, bool is_header);

  // Whether `status`, a grant's, made the receive start its next attempt: the peer closed the
  // connection on this process's silence before anything came (once per receive).
  bool GrantAgainAfterOwnSilenceLocked(const absl::Status& status);

  // `attempt`: the grants' attempt_; a result of an earlier attempt's grant only frees its buffer.
  void OnHeader(const GrantResult& result, const PoolBuffer& buffer, int attempt);

  void OnHeaderMessageLocked(const char* message, uint64_t length, bool fused);

  void OnData(const GrantResult& result, std::shared_ptr<PoolBuffer> buffer, int attempt);

  absl::Status RegrantLocked();

  // The data grant its header asked for: the tensor was expected small, or larger than it came.
  absl::Status GrantDataLocked();

  void MaybeOutputLocked();

  // The tensor from its header and `bytes` (header_->data_bytes of them). A memcpy-able tensor
  // aliases `landed`, their pool buffer, when given; else (inline bytes, in the header's buffer,
  // which goes back to the pool) it is copied out.
  void OutputLocked(const char* bytes, std::shared_ptr<PoolBuffer> landed);

  void FinishLocked(const absl::Status& status);

  void EndRegrantSpanLocked();
  const char* BackendOfLocked() const;  // for events

  // Holds mu_; the outermost one on a thread runs done_ once the receive finished, unlocked:
  // TensorFlow may run downstream kernels inline in it, on the transport's thread.
  class Locked {
   public:
    explicit Locked(TensorReceive* receive) : receive_(receive) {
      receive_->mu_.lock();
      ++receive_->lock_depth_;
    }
    ~Locked() {
      Done done;
      if (--receive_->lock_depth_ == 0 && receive_->finished_) std::swap(done, receive_->done_);
      receive_->mu_.unlock();
      if (done) done(receive_->status_, receive_->tensor_, receive_->dead_);
    }

   private:
    TensorReceive* const receive_;
  };

  const std::shared_ptr<Runtime> runtime_;
  const std::string peer_task_;
  const std::string key_;
  const int64_t step_id_;
  const std::string tensor_name_;
  const std::optional<FusedSlot> fused_;
  Done done_;

  // Recursive: a grant on a connection that already failed completes inside Grant().
  std::recursive_mutex mu_;
  int lock_depth_ = 0;
  bool finished_ = false;
  absl::Status status_;
  tensorflow::Tensor tensor_;
  bool dead_ = false;
  TransferTags tags_;
  std::string transfer_;  // the key less its frame and iteration
  std::shared_ptr<Connection> connection_;
  std::shared_ptr<BufferPool> pool_;
  uint64_t header_grant_ = 0;
  uint64_t data_grant_ = 0;
  std::optional<TensorHeader> header_;
  std::shared_ptr<PoolBuffer> data_;
  uint64_t data_length_ = 0;
  uint64_t needed_bytes_ = 0;  // a too-small data grant's needed size, until the header vouches for it
  // Grants are made again, once, over a new connection when the peer closed the first because this
  // process went silent (stopped, cut off) before anything came: the sender, whose writes failed
  // with that connection, sends the message again (RdmaRemoteRendezvous::WriteTo).
  int attempt_ = 0;
  TraceSpan span_;          // from Start to the tensor, or the receive's failure
  TraceSpan regrant_span_;  // from a data grant made once the header came to the data landing
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_TENSOR_RECEIVE_H_
