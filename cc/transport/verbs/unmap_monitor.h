// Tells the registration cache when memory it registered stops being the memory it registered.
//
// A memory registration pins the physical pages behind a virtual range. When the program frees a
// buffer (glibc returns big blocks to the kernel with munmap, trims heaps with MADV_DONTNEED) and a
// later allocation reuses the same addresses, a cache keyed by address would hand out a
// registration of the *old* pages, and the peer would receive stale bytes. The kernel reports such
// unmaps to a userfaultfd registered on the range (UFFD_EVENT_UNMAP / REMOVE / REMAP), which is what
// this monitor listens to. Without CONFIG_USERFAULTFD or permission to use it, nothing can be
// cached safely, and the cache registers per write instead.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_UNMAP_MONITOR_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_UNMAP_MONITOR_H_

#include <cstdint>
#include <string>
#include <vector>

namespace tf_rdma::verbs {

struct AddressRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;
};

class UnmapMonitor {
 public:
  // The process's one monitor (both extensions use the one transport library, setup.py), or
  // nullptr when the kernel does not let us watch (see why_unavailable).
  static UnmapMonitor* Get();
  static std::string why_unavailable();

  // Starts watching the page-aligned [begin, end). False when it cannot be watched (e.g. a
  // file-backed mapping); such memory must not be cached.
  bool Watch(AddressRange range);

  // Appends every range unmapped since `*cursor` to `out` and advances the cursor. Every unmap that
  // completed before this call is included; `*overflowed` is set when events were lost (drop all).
  void Collect(uint64_t* cursor, std::vector<AddressRange>* out, bool* overflowed);
  uint64_t head() const;

 private:
  explicit UnmapMonitor(int fd);
  void Loop();
  void ReadEvents();

  const int fd_;
  struct State;
  State* state_;
};

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_UNMAP_MONITOR_H_
