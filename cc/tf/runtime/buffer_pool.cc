#include "cc/tf/runtime/buffer_pool.h"

#include <algorithm>
#include <vector>

namespace tf_rdma {

PoolBuffer::~PoolBuffer() { pool_->Release(slab_, offset_, capacity_); }

std::unique_ptr<PoolBuffer> BufferPool::LendLocked(uint64_t slab, uint64_t offset, uint64_t capacity) {
  Slab& lent_from = slabs_.at(slab);
  lent_from.buffers_lent++;
  usage_.buffers_in_use++;
  usage_.bytes_in_use += capacity;
  return std::unique_ptr<PoolBuffer>(new PoolBuffer(shared_from_this(), lent_from.region, slab, offset, capacity));
}

absl::StatusOr<std::unique_ptr<PoolBuffer>> BufferPool::Allocate(uint64_t bytes) {
  const uint64_t capacity = std::max<uint64_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  std::lock_guard<std::mutex> lock(mu_);
  const bool dedicated = capacity > max_slab_bytes_ / 2;
  if (!dedicated) {
    for (auto& [s, slab] : slabs_) {
      if (slab.dedicated) continue;
      for (auto it = slab.free.begin(); it != slab.free.end(); ++it) {
        if (it->second < capacity) continue;
        const uint64_t offset = it->first;
        const uint64_t rest = it->second - capacity;
        slab.free.erase(it);
        if (rest > 0) slab.free.emplace(offset + capacity, rest);
        return LendLocked(s, offset, capacity);
      }
    }
  }
  // Reuse a dedicated region that is free and big enough but not wastefully so.
  for (auto& [s, slab] : slabs_) {
    if (!dedicated) break;
    if (!slab.dedicated || slab.free.empty()) continue;
    const uint64_t size = slab.region->size();
    if (size >= capacity && size <= 2 * capacity) {
      slab.free.clear();
      return LendLocked(s, 0, size);
    }
  }
  const uint64_t region_bytes = dedicated ? capacity : NextSlabBytesLocked(capacity);
  absl::StatusOr<std::shared_ptr<MemoryRegion>> region = transport_->AllocateRegion(region_bytes);
  if (!region.ok()) return region.status();
  Slab slab{*region, {}, dedicated};
  if (!dedicated && capacity < region_bytes) slab.free.emplace(capacity, region_bytes - capacity);
  const uint64_t index = next_slab_++;
  slabs_.emplace(index, std::move(slab));
  if (!dedicated) slab_region_bytes_ += region_bytes;
  usage_.region_bytes += region_bytes;
  return LendLocked(index, 0, dedicated ? region_bytes : capacity);
}

uint64_t BufferPool::NextSlabBytesLocked(uint64_t capacity) const {
  uint64_t bytes = std::max(min_slab_bytes_, slab_region_bytes_);
  while (bytes < capacity) bytes *= 2;
  return std::min(bytes, max_slab_bytes_);
}

void BufferPool::Release(uint64_t index, uint64_t offset, uint64_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  Slab& slab = slabs_.at(index);
  usage_.buffers_in_use--;
  usage_.bytes_in_use -= capacity;
  if (--slab.buffers_lent == 0) slab.idle_since = absl::Now();
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

void BufferPool::ReleaseIdle(absl::Time now, absl::Duration quiet) {
  // Destroyed after the lock is let go: deregistering a region (verbs) takes a while.
  std::vector<std::shared_ptr<MemoryRegion>> released;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    Slab& slab = it->second;
    if (slab.buffers_lent > 0 || now - slab.idle_since < quiet) {
      ++it;
      continue;
    }
    const uint64_t bytes = slab.region->size();
    if (!slab.dedicated) slab_region_bytes_ -= bytes;
    usage_.region_bytes -= bytes;
    released.push_back(std::move(slab.region));
    it = slabs_.erase(it);
  }
}

BufferPool::Usage BufferPool::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

}  // namespace tf_rdma
