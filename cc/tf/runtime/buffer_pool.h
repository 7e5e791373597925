// Receive buffers carved out of a transport's regions: what the kernels grant to one peer and what
// the tensors received from it alias. A buffer goes back to the pool only when its last user (the
// tensor, or a grant still outstanding) lets go, so no byte is reused while anything can still
// read or write it. A region none of whose buffers is lent goes back to the transport (on verbs,
// deregistered) once it stayed so for a quiet period (ReleaseIdle), so a peer that sent once does
// not keep its regions for good.
#ifndef TF_RDMA_CC_TF_RUNTIME_BUFFER_POOL_H_
#define TF_RDMA_CC_TF_RUNTIME_BUFFER_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

class BufferPool;

// A granted-or-filled range of a region; returns itself to its pool when destroyed.
class PoolBuffer {
 public:
  ~PoolBuffer();
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;

  const std::shared_ptr<MemoryRegion>& region() const { return region_; }
  uint64_t offset() const { return offset_; }
  uint64_t capacity() const { return capacity_; }
  char* data() const { return region_->data() + offset_; }

 private:
  friend class BufferPool;
  PoolBuffer(std::shared_ptr<BufferPool> pool, std::shared_ptr<MemoryRegion> region, uint64_t slab,
             uint64_t offset, uint64_t capacity)
      : pool_(std::move(pool)), region_(std::move(region)), slab_(slab), offset_(offset),
        capacity_(capacity) {}

  std::shared_ptr<BufferPool> pool_;
  std::shared_ptr<MemoryRegion> region_;
  uint64_t slab_;
  uint64_t offset_;
  uint64_t capacity_;
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Buffers are aligned for Eigen (64 bytes). Regions are carved into buffers a slab at a time;
  // slabs start at `min_slab_bytes` and double with what the pool holds up to `max_slab_bytes`,
  // since a pool serves one peer and most peers need little (on verbs every byte is pinned). A
  // request larger than half the largest slab gets a region of its own.
  static constexpr uint64_t kAlignment = 64;
  BufferPool(Transport* transport, uint64_t min_slab_bytes, uint64_t max_slab_bytes)
      : transport_(transport), min_slab_bytes_(min_slab_bytes), max_slab_bytes_(max_slab_bytes) {}

  absl::StatusOr<std::unique_ptr<PoolBuffer>> Allocate(uint64_t bytes);

  struct Usage {
    uint64_t region_bytes = 0;
    uint64_t buffers_in_use = 0;
    uint64_t bytes_in_use = 0;
  };
  Usage usage() const;

  // Gives back the regions none of whose buffers was lent since `now - quiet`. No buffer of such a
  // region exists, so no grant into it is out: nothing, here or at the peer, writes into it any
  // more.
  void ReleaseIdle(absl::Time now, absl::Duration quiet);

 private:
  friend class PoolBuffer;
  struct Slab {
    std::shared_ptr<MemoryRegion> region;
    std::map<uint64_t, uint64_t> free;  // offset -> length, coalesced
    bool dedicated;
    uint64_t buffers_lent = 0;
    absl::Time idle_since;  // when buffers_lent last fell to 0
  };
  std::unique_ptr<PoolBuffer> LendLocked(uint64_t slab, uint64_t offset, uint64_t capacity);
  void Release(uint64_t slab, uint64_t offset, uint64_t capacity);
  uint64_t NextSlabBytesLocked(uint64_t capacity) const;

  Transport* const transport_;
  const uint64_t min_slab_bytes_;
  const uint64_t max_slab_bytes_;
  uint64_t slab_region_bytes_ = 0;  // in slabs, not in dedicated regions
  mutable std::mutex mu_;
  // By a number that only grows: buffers name their slab by it while others come and go, and
  // the oldest slabs are tried first.
  std::map<uint64_t, Slab> slabs_;
  uint64_t next_slab_ = 0;
  Usage usage_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_BUFFER_POOL_H_
