// Memory registrations for the verbs backend: RAII registration of a range, with the pinned-memory
// accounting and `ulimit -l` errors, and the cache that keeps send-side source buffers registered
// so a buffer written again and again is registered once.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_REGISTRATION_CACHE_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_REGISTRATION_CACHE_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "cc/transport/fork_guard.h"
#include "cc/transport/verbs/unmap_monitor.h"

namespace tf_rdma::verbs {

class Registration {
 public:
  // Registers the pages covering [addr, addr + length) with `access` (0: local reads only).
  static absl::StatusOr<std::shared_ptr<Registration>> Create(ibv_pd* pd, const void* addr,
                                                              size_t length, int access,
                                                              const std::string& what);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  ibv_mr* mr() const { return mr_; }
  AddressRange range() const { return range_; }
  bool Covers(const void* addr, size_t length) const;

 private:
  Registration(ibv_mr* mr, AddressRange range) : mr_(mr), range_(range) {}
  ibv_mr* const mr_;
  const AddressRange range_;
  const OwningProcess owner_;
};

// Counters of every registration cache in the process (TensorFlow's servers' and the Python
// bindings' transports share the one transport library), for tests and `python -m tf_rdma info`.
struct RegistrationCacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t invalidations = 0;  // entries dropped because their memory was unmapped
  uint64_t uncached = 0;       // registrations used once because the memory cannot be watched
};
RegistrationCacheStats GetRegistrationCacheStats();

// Source buffers of writes, registered for local access only, per protection domain. Entries stay
// registered until evicted (least recently used beyond the limits) or until their memory is
// unmapped; a registration in use by a posted write stays alive through its shared_ptr.
class RegistrationCache {
 public:
  RegistrationCache(ibv_pd* pd, std::string device, size_t max_entries, size_t max_bytes);
  ~RegistrationCache();

  absl::StatusOr<std::shared_ptr<Registration>> Acquire(const void* addr, size_t length);

 private:
  struct Entry {
    std::shared_ptr<Registration> registration;
    uint64_t last_use = 0;
  };
  // Lock held. Drops entries whose memory was unmapped since the last call.
  void ApplyUnmapsLocked(std::vector<std::shared_ptr<Registration>>* dropped);
  void EvictLocked(std::vector<std::shared_ptr<Registration>>* dropped);

  ibv_pd* const pd_;
  const std::string device_;
  const size_t max_entries_;
  const size_t max_bytes_;
  UnmapMonitor* const monitor_;

  std::mutex mu_;
  std::map<uintptr_t, Entry> entries_;  // by range begin
  size_t cached_bytes_ = 0;
  uint64_t clock_ = 0;
  uint64_t unmap_cursor_ = 0;
};

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_REGISTRATION_CACHE_H_
