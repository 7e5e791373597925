// Where tensors from each peer land: a receive pool per connection. Its regions are granted to that
// connection alone, so a faulty or hostile peer can write nowhere but into the tensors it sends us
// (received tensors are never reused as other ops' outputs: PoolTensorBuffer).
#ifndef TF_RDMA_CC_TF_RUNTIME_RECEIVE_POOLS_H_
#define TF_RDMA_CC_TF_RUNTIME_RECEIVE_POOLS_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/tf/runtime/buffer_pool.h"
#include "cc/tf/runtime/transports.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

class ReceivePools {
 public:
  // Pools grow by slabs of `min_slab_bytes` to `max_slab_bytes` (BufferPool); a live pool's regions
  // go once idle for `idle` (none if zero).
  ReceivePools(Transports& transports, uint64_t min_slab_bytes, uint64_t max_slab_bytes, absl::Duration idle);
  ~ReceivePools();

  // Starts the one thread that frees idle regions, whatever the number of peers, since a pool whose
  // peer went quiet is called by nothing else. It checks every pool a few times per idle period.
  void StartReleasingIdleRegions();

  // The pool of `connection`, made at its first receive. Once the connection is replaced, its pool
  // is retired: no new buffer comes from it, and its regions go (on verbs, deregistered) when the
  // last tensor received into them is dropped.
  absl::StatusOr<std::shared_ptr<BufferPool>> For(const std::shared_ptr<Connection>& connection);
  // Retires the pool of `connection`, which ended.
  void Retire(const std::shared_ptr<Connection>& connection);
  // Per backend, what the live connections' receive pools hold and what is lent out now
  // (received tensors alias pool buffers until TensorFlow drops them).
  std::map<Backend, BufferPool::Usage> Usage() const;

 private:
  // `connection`'s pool, if it has one yet; with mu_ held.
  std::shared_ptr<BufferPool> PoolOfLocked(const std::shared_ptr<Connection>& connection) const;
  void ReleaseIdleRegions();

  Transports& transports_;
  const uint64_t min_slab_bytes_;
  const uint64_t max_slab_bytes_;
  const absl::Duration idle_;
  mutable std::mutex mu_;
  struct ConnectionPool {
    std::weak_ptr<Connection> connection;
    Backend backend;
    std::shared_ptr<BufferPool> pool;
  };
  std::unordered_map<const Connection*, ConnectionPool> pools_;
  bool stopping_ = false;  // guarded by mu_
  std::condition_variable stop_;
  std::thread idle_region_releaser_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_RECEIVE_POOLS_H_
