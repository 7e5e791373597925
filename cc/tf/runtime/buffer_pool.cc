#include "cc/tf/runtime/buffer_pool.h"

#include <algorithm>

namespace tf_rdma {

PoolBuffer::~PoolBuffer() { pool_->Release(slab_, offset_, capacity_); }

absl::StatusOr<std::unique_ptr<PoolBuffer>> BufferPool::Allocate(uint64_t bytes) {
  const uint64_t capacity = std::max<uint64_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  std::lock_guard<std::mutex> lock(mu_);
  const bool dedicated = capacity > max_slab_bytes_ / 2;
  if (!dedicated) {
    for (size_t s = 0; s < slabs_.size(); ++s) {
      Slab& slab = slabs_[s];
      if (slab.dedicated) continue;
      for (auto it = slab.free.begin(); it != slab.free.end(); ++it) {
        if (it->second < capacity) continue;
        const uint64_t offset = it->first;
        const uint64_t rest = it->second - capacity;
        slab.free.erase(it);
        if (rest > 0) slab.free.emplace(offset + capacity, rest);
        usage_.buffers_in_use++;
        usage_.bytes_in_use += capacity;
        return std::unique_ptr<PoolBuffer>(
            new PoolBuffer(shared_from_this(), slab.region, s, offset, capacity));
      }
    }
  }
  // Reuse a dedicated region that is free and big enough but not wastefully so.
  for (size_t s = 0; dedicated && s < slabs_.size(); ++s) {
    Slab& slab = slabs_[s];
    if (!slab.dedicated || slab.free.empty()) continue;
    const uint64_t size = slab.region->size();
    if (size >= capacity && size <= 2 * capacity) {
      slab.free.clear();
      usage_.buffers_in_use++;
      usage_.bytes_in_use += size;
      return std::unique_ptr<PoolBuffer>(new PoolBuffer(shared_from_this(), slab.region, s, 0, size));
    }
  }
  const uint64_t region_bytes = dedicated ? capacity : NextSlabBytesLocked(capacity);
  absl::StatusOr<std::shared_ptr<MemoryRegion>> region = transport_->AllocateRegion(region_bytes);
  if (!region.ok()) return region.status();
  Slab slab{*region, {}, dedicated};
  if (!dedicated && capacity < region_bytes) slab.free.emplace(capacity, region_bytes - capacity);
  slabs_.push_back(std::move(slab));
  if (!dedicated) slab_region_bytes_ += region_bytes;
  usage_.region_bytes += region_bytes;
  usage_.buffers_in_use++;
  usage_.bytes_in_use += dedicated ? region_bytes : capacity;
  const size_t index = slabs_.size() - 1;
  return std::unique_ptr<PoolBuffer>(new PoolBuffer(shared_from_this(), slabs_[index].region, index, 0,
                                                    dedicated ? region_bytes : capacity));
}

uint64_t BufferPool::NextSlabBytesLocked(uint64_t capacity) const {
  uint64_t bytes = std::max(min_slab_bytes_, slab_region_bytes_);
  while (bytes < capacity) bytes *= 2;
  return std::min(bytes, max_slab_bytes_);
}

void BufferPool::Release(size_t index, uint64_t offset, uint64_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  Slab& slab = slabs_[index];
  usage_.buffers_in_use--;
  usage_.bytes_in_use -= capacity;
  auto [it, inserted] = slab.free.emplace(offset, capacity);
  // Coalesce with the neighbours so large buffers stay possible.
  auto next = std::next(it);
  if (next != slab.free.end() && it->first + it->second == next->first) {
    it->second += next->second;
    slab.free.erase(next);
  }
  if (it != slab.free.begin()) {
    auto previous = std::prev(it);
    if (previous->first + previous->second == it->first) {
      previous->second += it->second;
      slab.free.erase(it);
    }
  }
}

BufferPool::Usage BufferPool::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

}  // namespace tf_rdma
