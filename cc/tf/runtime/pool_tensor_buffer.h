// A tensor's storage that lives in a pool buffer of a granted region: a received tensor aliases
// the bytes where they landed, and the buffer returns to the pool when TensorFlow drops it.
#ifndef TF_RDMA_CC_TF_RUNTIME_POOL_TENSOR_BUFFER_H_
#define TF_RDMA_CC_TF_RUNTIME_POOL_TENSOR_BUFFER_H_

#include <memory>
#include <utility>

#include "cc/tf/runtime/buffer_pool.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {

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

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_POOL_TENSOR_BUFFER_H_
