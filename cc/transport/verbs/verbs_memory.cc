#include "cc/transport/verbs/verbs_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/verbs/verbs_device.h"

namespace tf_rdma::verbs {
namespace {

bool HasQueuePairWindows(ibv_context* context) {
  ibv_device_attr attr{};
  if (ibv_query_device(context, &attr) != 0) return false;
  return (attr.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
}

}  // namespace

DeviceContext::DeviceContext(ibv_context* context, ibv_pd* pd)
    : context(context),
      pd(pd),
      name(DeviceName(context)),
      memory_windows(HasQueuePairWindows(context)),
      send_cache(std::make_unique<RegistrationCache>(pd, DeviceName(context), /*max_entries=*/1024,
                                                     /*max_bytes=*/size_t{4} << 30)) {
  if (!memory_windows) {
    LOG(WARNING) << "tf_rdma: RDMA device " << name << " has no type 2 memory windows: the keys of the "
                 << "receive regions granted to one peer are valid on every connection of the device, "
                 << "so a cluster member that guesses another peer's key can write there (README, Security)";
  }
}

int DeviceContext::remote_region_access() const {
  return IBV_ACCESS_LOCAL_WRITE | (memory_windows ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_WRITE);
}

DeviceContext::~DeviceContext() {
  send_cache.reset();
  ibv_dealloc_pd(pd);
}

VerbsRegion::VerbsRegion(uint32_t id, char* data, size_t size,
                         std::vector<std::pair<ibv_pd*, std::shared_ptr<Registration>>> registrations,
                         std::vector<std::shared_ptr<DeviceContext>> devices)
    : MemoryRegion(id, data, size), registrations_(std::move(registrations)), devices_(std::move(devices)) {}

VerbsRegion::~VerbsRegion() {
  // Windows first (a registration with windows bound into it cannot go), then deregister while
  // the pages are still mapped.
  for (const auto& window : windows_) window->Deallocate();
  registrations_.clear();
  munmap(data(), std::max<size_t>(size(), 1));
}

absl::StatusOr<std::shared_ptr<MemoryWindow>> MemoryWindow::Allocate(ibv_pd* pd) {
  ibv_mw* mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
  if (mw == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("ibv_alloc_mw: ", std::strerror(errno)));
  }
  return std::make_shared<MemoryWindow>(mw);
}

absl::StatusOr<std::shared_ptr<MemoryWindow>> VerbsRegion::NewWindow(ibv_pd* pd) {
  absl::StatusOr<std::shared_ptr<MemoryWindow>> window = MemoryWindow::Allocate(pd);
  if (!window.ok()) return window;
  std::lock_guard<std::mutex> lock(windows_mu_);
  // A pool region outlives many connections: forget the windows their connections freed.
  windows_.erase(std::remove_if(windows_.begin(), windows_.end(),
                                [](const auto& old) { return old->get() == nullptr; }),
                 windows_.end());
  windows_.push_back(*window);
  return window;
}

const Registration* VerbsRegion::RegistrationFor(ibv_pd* pd) const {
  for (const auto& [domain, registration] : registrations_) {
    if (domain == pd) return registration.get();
  }
  return nullptr;
}

}  // namespace tf_rdma::verbs
