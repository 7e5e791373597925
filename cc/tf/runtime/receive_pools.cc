#include "cc/tf/runtime/receive_pools.h"

#include <algorithm>
#include <vector>

namespace tf_rdma {

ReceivePools::ReceivePools(Transports& transports, uint64_t min_slab_bytes, uint64_t max_slab_bytes,
                           absl::Duration idle)
    : transports_(transports), min_slab_bytes_(min_slab_bytes), max_slab_bytes_(max_slab_bytes), idle_(idle) {}

ReceivePools::~ReceivePools() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_.notify_all();
  if (idle_region_releaser_.joinable()) idle_region_releaser_.join();
}

void ReceivePools::StartReleasingIdleRegions() {
  if (idle_ > absl::ZeroDuration()) idle_region_releaser_ = std::thread([this] { ReleaseIdleRegions(); });
}

absl::StatusOr<std::shared_ptr<BufferPool>> ReceivePools::For(const std::shared_ptr<Connection>& connection) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::shared_ptr<BufferPool> pool = PoolOfLocked(connection)) return pool;
  }
  // A connection's first receive: only it needs the transport (whose lookup takes a lock of its own).
  absl::StatusOr<Transport*> transport = transports_.For(connection->backend());
  if (!transport.ok()) return transport.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (std::shared_ptr<BufferPool> pool = PoolOfLocked(connection)) return pool;  // made meanwhile
  // A connection's first receive. Pools of connections that ended without being replaced (their
  // peer died and never came back) go now, not at the process's end.
  for (auto it = pools_.begin(); it != pools_.end();) {
    std::shared_ptr<Connection> owner = it->second.connection.lock();
    it = owner && owner->health().ok() ? std::next(it) : pools_.erase(it);
  }
  auto pool = std::make_shared<BufferPool>(*transport, min_slab_bytes_, max_slab_bytes_);
  pools_[connection.get()] = ConnectionPool{connection, connection->backend(), pool};
  return pool;
}

std::shared_ptr<BufferPool> ReceivePools::PoolOfLocked(const std::shared_ptr<Connection>& connection) const {
  auto found = pools_.find(connection.get());
  if (found != pools_.end() && found->second.connection.lock() == connection) return found->second.pool;
  return nullptr;
}

void ReceivePools::Retire(const std::shared_ptr<Connection>& connection) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pools_.find(connection.get());
  if (it != pools_.end() && it->second.connection.lock() == connection) pools_.erase(it);
}

void ReceivePools::ReleaseIdleRegions() {
  // A region goes between `idle_` and 1.25 `idle_` after its last buffer came back.
  const auto period = absl::ToChronoMilliseconds(std::max(idle_ / 4, absl::Milliseconds(1)));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_.wait_for(lock, period, [this] { return stopping_; })) {
    std::vector<std::shared_ptr<BufferPool>> pools;
    for (const auto& [connection, entry] : pools_) pools.push_back(entry.pool);
    lock.unlock();
    const absl::Time now = absl::Now();
    for (const std::shared_ptr<BufferPool>& pool : pools) pool->ReleaseIdle(now, idle_);
    pools.clear();  // a retired pool's last owner may be this list: it goes without mu_ held
    lock.lock();
  }
}

std::map<Backend, BufferPool::Usage> ReceivePools::Usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<Backend, BufferPool::Usage> usage;
  for (const auto& [connection, entry] : pools_) {
    const BufferPool::Usage pool = entry.pool->usage();
    BufferPool::Usage& total = usage[entry.backend];
    total.region_bytes += pool.region_bytes;
    total.buffers_in_use += pool.buffers_in_use;
    total.bytes_in_use += pool.bytes_in_use;
  }
  return usage;
}

}  // namespace tf_rdma
