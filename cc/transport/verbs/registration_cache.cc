#include "cc/transport/verbs/registration_cache.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/verbs/verbs_device.h"

namespace tf_rdma::verbs {
namespace {

std::atomic<uint64_t> stat_hits{0}, stat_misses{0}, stat_evictions{0}, stat_invalidations{0},
    stat_uncached{0};

uintptr_t PageSize() {
  static const uintptr_t size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return size;
}

AddressRange PagesCovering(const void* addr, size_t length) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) & ~(PageSize() - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + std::max<size_t>(length, 1) + PageSize() - 1) &
                        ~(PageSize() - 1);
  return {begin, end};
}

}  // namespace

RegistrationCacheStats GetRegistrationCacheStats() {
  return {stat_hits.load(), stat_misses.load(), stat_evictions.load(), stat_invalidations.load(),
          stat_uncached.load()};
}

absl::StatusOr<std::shared_ptr<Registration>> Registration::Create(ibv_pd* pd, const void* addr,
                                                                   size_t length, int access,
                                                                   const std::string& what) {
  EnsureForkSafety();
  const AddressRange range = PagesCovering(addr, length);
  const size_t bytes = range.end - range.begin;
  const std::string device = DeviceName(pd->context);
  absl::Status allowed = CheckMemlockAllows(what, bytes, device);
  if (!allowed.ok()) return allowed;
  ibv_mr* mr = ibv_reg_mr(pd, reinterpret_cast<void*>(range.begin), bytes, access);
  if (mr == nullptr) return RegistrationError(what, bytes, errno, device);
  AddPinnedBytes(static_cast<ptrdiff_t>(bytes));
  return std::shared_ptr<Registration>(new Registration(mr, range));
}

Registration::~Registration() {
  if (owner_.Inherited()) return;  // the context is the parent's too (fork_guard.h)
  const int rc = ibv_dereg_mr(mr_);
  if (rc != 0) LOG(WARNING) << "tf_rdma: ibv_dereg_mr failed: " << std::strerror(rc);
  AddPinnedBytes(-static_cast<ptrdiff_t>(range_.end - range_.begin));
}

bool Registration::Covers(const void* addr, size_t length) const {
  const AddressRange need = PagesCovering(addr, length);
  return need.begin >= range_.begin && need.end <= range_.end;
}

RegistrationCache::RegistrationCache(ibv_pd* pd, std::string device, size_t max_entries,
                                     size_t max_bytes)
    : pd_(pd),
      device_(std::move(device)),
      max_entries_(max_entries),
      max_bytes_(max_bytes),
      monitor_(UnmapMonitor::Get()) {
  if (monitor_ == nullptr) {
    LOG(WARNING) << "tf_rdma: verbs send buffers are registered per write, uncached, because the "
                    "kernel cannot report when they are unmapped ("
                 << UnmapMonitor::why_unavailable() << ")";
  } else {
    unmap_cursor_ = monitor_->head();
  }
}

RegistrationCache::~RegistrationCache() {
  std::map<uintptr_t, Entry> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.swap(entries_);
  }
}

void RegistrationCache::ApplyUnmapsLocked(std::vector<std::shared_ptr<Registration>>* dropped) {
  std::vector<AddressRange> unmapped;
  bool overflowed = false;
  monitor_->Collect(&unmap_cursor_, &unmapped, &overflowed);
  if (unmapped.empty() && !overflowed) return;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const AddressRange r = it->second.registration->range();
    bool stale = overflowed;
    for (const auto& u : unmapped) stale = stale || (u.begin < r.end && r.begin < u.end);
    if (!stale) {
      ++it;
      continue;
    }
    stat_invalidations++;
    cached_bytes_ -= r.end - r.begin;
    dropped->push_back(std::move(it->second.registration));
    it = entries_.erase(it);
  }
}

void RegistrationCache::EvictLocked(std::vector<std::shared_ptr<Registration>>* dropped) {
  while (!entries_.empty() && (entries_.size() > max_entries_ || cached_bytes_ > max_bytes_)) {
    auto oldest = entries_.begin();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.last_use < oldest->second.last_use) oldest = it;
    }
    const AddressRange r = oldest->second.registration->range();
    cached_bytes_ -= r.end - r.begin;
    dropped->push_back(std::move(oldest->second.registration));
    entries_.erase(oldest);
    stat_evictions++;
  }
}

absl::StatusOr<std::shared_ptr<Registration>> RegistrationCache::Acquire(const void* addr,
                                                                         size_t length) {
  // Registrations are destroyed outside the lock: deregistering may free memory.
  std::vector<std::shared_ptr<Registration>> dropped;
  if (monitor_ != nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    ApplyUnmapsLocked(&dropped);
    const AddressRange need = PagesCovering(addr, length);
    // Entries may overlap; any that starts at or before the first page can cover the range.
    for (auto it = entries_.upper_bound(need.begin); it != entries_.begin();) {
      --it;
      if (it->second.registration->Covers(addr, length)) {
        it->second.last_use = ++clock_;
        stat_hits++;
        return it->second.registration;
      }
    }
  }
  stat_misses++;
  absl::StatusOr<std::shared_ptr<Registration>> registration =
      Registration::Create(pd_, addr, length, /*access=*/0, "a send buffer");
  if (!registration.ok()) return registration.status();
  const AddressRange range = (*registration)->range();
  if (monitor_ == nullptr || range.end - range.begin > max_bytes_ || !monitor_->Watch(range)) {
    stat_uncached++;
    return registration;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // The caller keeps the buffer mapped until its write completes (Write's contract), so it cannot
  // have been unmapped between registering and watching.
  ApplyUnmapsLocked(&dropped);
  auto [it, inserted] = entries_.emplace(range.begin, Entry{*registration, ++clock_});
  if (!inserted) {
    // Keep the larger of two registrations that start at the same page.
    const AddressRange old = it->second.registration->range();
    if (old.end >= range.end) return registration;
    cached_bytes_ -= old.end - old.begin;
    dropped.push_back(std::move(it->second.registration));
    it->second = Entry{*registration, clock_};
  }
  cached_bytes_ += range.end - range.begin;
  EvictLocked(&dropped);
  return registration;
}

}  // namespace tf_rdma::verbs
