// The memory a verbs transport registers: the devices it uses, the regions peers write into, and
// the memory windows through which one connection's peer may write into one region.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MEMORY_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MEMORY_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/transport/fork_guard.h"
#include "cc/transport/transport.h"
#include "cc/transport/verbs/registration_cache.h"

namespace tf_rdma::verbs {

// One RDMA device as the transport uses it: a protection domain and the send-buffer cache.
struct DeviceContext {
  DeviceContext(ibv_context* context, ibv_pd* pd);
  ~DeviceContext();
  ibv_context* const context;  // owned by rdma_cm (rdma_get_devices)
  ibv_pd* const pd;
  const std::string name;
  // Type 2 memory windows: a window is bound to one queue pair, so the key a peer is given works
  // on its own connection only. Without them a region's key is valid on every queue pair of `pd`.
  const bool memory_windows;
  // Access flags of memory peers may write into: remote writes go through windows when the device
  // has them, so the registration itself grants none.
  int remote_region_access() const;
  // Emptied before the protection domain goes: its registrations belong to it.
  std::unique_ptr<RegistrationCache> send_cache;
};

// A type 2 memory window, bound to one connection's queue pair and pointing into one region. It
// is deallocated by whichever goes first: the region (a peer's key dies with the memory) or the
// connection, before its queue pair (under rxe, destroying a queue pair with a window still
// bound to it stalled each close for about 51 s).
class MemoryWindow {
 public:
  static absl::StatusOr<std::shared_ptr<MemoryWindow>> Allocate(ibv_pd* pd);
  explicit MemoryWindow(ibv_mw* mw) : mw_(mw) {}
  ~MemoryWindow() { Deallocate(); }
  MemoryWindow(const MemoryWindow&) = delete;
  MemoryWindow& operator=(const MemoryWindow&) = delete;
  ibv_mw* get() const { return mw_.load(); }
  void Deallocate() {
    if (owner_.Inherited()) return;  // the context is the parent's too (fork_guard.h)
    if (ibv_mw* mw = mw_.exchange(nullptr)) ibv_dealloc_mw(mw);
  }

 private:
  std::atomic<ibv_mw*> mw_;
  const OwningProcess owner_;
};

// A region peers may write into: registered on every device in use, for remote writes through
// per-connection memory windows (or directly where the device has none).
class VerbsRegion : public MemoryRegion {
 public:
  VerbsRegion(uint32_t id, char* data, size_t size,
              std::vector<std::pair<ibv_pd*, std::shared_ptr<Registration>>> registrations,
              std::vector<std::shared_ptr<DeviceContext>> devices);
  ~VerbsRegion() override;
  // Null when the region is not registered in `pd` (another transport's, or another device's).
  const Registration* RegistrationFor(ibv_pd* pd) const;
  // A type 2 memory window for a connection to bind into this region. The region deallocates it
  // (if its connection has not) before deregistering: a peer's key dies with the memory, however
  // long the connection it was given on lives.
  absl::StatusOr<std::shared_ptr<MemoryWindow>> NewWindow(ibv_pd* pd);

 private:
  std::mutex windows_mu_;
  std::vector<std::shared_ptr<MemoryWindow>> windows_;
  std::vector<std::pair<ibv_pd*, std::shared_ptr<Registration>>> registrations_;
  const std::vector<std::shared_ptr<DeviceContext>> devices_;  // outlive the registrations
};

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_VERBS_MEMORY_H_
