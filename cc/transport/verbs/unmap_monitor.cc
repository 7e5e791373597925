#include "cc/transport/verbs/unmap_monitor.h"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
namespace {

constexpr size_t kRingSize = 4096;
std::string unavailable_reason;

int OpenUserfaultfd() {
  // User-mode-only faults are all we need, and are allowed to unprivileged processes even when
  // vm.unprivileged_userfaultfd is 0 (kernel 5.11+). Older kernels reject the flag: retry without.
  int fd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (fd < 0 && errno == EINVAL) fd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd < 0) {
    unavailable_reason = absl::StrCat("userfaultfd: ", std::strerror(errno));
    return -1;
  }
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_REMAP;
  if (ioctl(fd, UFFDIO_API, &api) != 0) {
    unavailable_reason = absl::StrCat("UFFDIO_API: ", std::strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

// The ring holds unmapped ranges in arrival order; readers keep a cursor. Appending never allocates,
// since the thread blocked in munmap may be one that holds an allocator lock.
struct UnmapMonitor::State {
  std::mutex ring_mu;
  std::array<AddressRange, kRingSize> ring;
  uint64_t head = 0;  // events ever appended
  // Readers that took events off the fd and have not appended them yet: an unmap whose event was
  // read has already returned to its caller, so Collect must wait for these.
  std::atomic<int> reading{0};
  std::mutex read_mu;
};

UnmapMonitor* UnmapMonitor::Get() {
  static UnmapMonitor* monitor = [] () -> UnmapMonitor* {
    const int fd = OpenUserfaultfd();
    return fd < 0 ? nullptr : new UnmapMonitor(fd);
  }();
  return monitor;
}

std::string UnmapMonitor::why_unavailable() { return unavailable_reason; }

UnmapMonitor::UnmapMonitor(int fd) : fd_(fd), state_(new State) {
  // Lives as long as the process: munmap of watched memory waits for this thread to read the event.
  std::thread([this] { Loop(); }).detach();
}

bool UnmapMonitor::Watch(AddressRange range) {
  uffdio_register reg{};
  reg.range.start = range.begin;
  reg.range.len = range.end - range.begin;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  if (ioctl(fd_, UFFDIO_REGISTER, &reg) == 0) return true;
  // EBUSY: another userfaultfd watches it already; EINVAL: file-backed or otherwise unsupported.
  return false;
}

void UnmapMonitor::Loop() {
  while (true) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, -1) < 0 && errno != EINTR) return;
    ReadEvents();
  }
}

void UnmapMonitor::ReadEvents() {
  std::lock_guard<std::mutex> reader(state_->read_mu);
  state_->reading++;
  std::array<uffd_msg, 64> messages;
  while (true) {
    const ssize_t n = read(fd_, messages.data(), sizeof(messages));
    if (n <= 0) break;
    for (size_t i = 0; i < static_cast<size_t>(n) / sizeof(uffd_msg); ++i) {
      const uffd_msg& m = messages[i];
      AddressRange range;
      switch (m.event) {
        case UFFD_EVENT_UNMAP:
          range = {m.arg.remove.start, m.arg.remove.end};
          break;
        case UFFD_EVENT_REMOVE: {
          range = {m.arg.remove.start, m.arg.remove.end};
          // The pages are gone; stop owning their faults so the kernel zero-fills them as usual.
          uffdio_range gone{m.arg.remove.start, m.arg.remove.end - m.arg.remove.start};
          ioctl(fd_, UFFDIO_UNREGISTER, &gone);
          break;
        }
        case UFFD_EVENT_REMAP:
          range = {m.arg.remap.from, m.arg.remap.from + m.arg.remap.len};
          break;
        case UFFD_EVENT_PAGEFAULT: {
          // A watched page went missing and is touched again: give it what the kernel would have,
          // a zero page, and wake the faulting thread.
          const uintptr_t page = m.arg.pagefault.address & ~uintptr_t{4095};
          uffdio_zeropage zero{};
          zero.range = {page, 4096};
          if (ioctl(fd_, UFFDIO_ZEROPAGE, &zero) != 0) {
            uffdio_range wake{page, 4096};
            ioctl(fd_, UFFDIO_WAKE, &wake);
          }
          continue;
        }
        default:
          continue;
      }
      std::lock_guard<std::mutex> lock(state_->ring_mu);
      state_->ring[state_->head % kRingSize] = range;
      state_->head++;
    }
  }
  state_->reading--;
}

uint64_t UnmapMonitor::head() const {
  std::lock_guard<std::mutex> lock(state_->ring_mu);
  return state_->head;
}

void UnmapMonitor::Collect(uint64_t* cursor, std::vector<AddressRange>* out, bool* overflowed) {
  // Events still queued in the fd belong to unmaps that have not returned yet, but reading them now
  // costs little and keeps the ring current.
  ReadEvents();
  while (state_->reading.load() > 0) std::this_thread::yield();
  // Allocate before locking: a free() inside push_back could unmap watched memory and wait for the
  // monitor thread, which needs ring_mu.
  out->reserve(out->size() + kRingSize);
  std::lock_guard<std::mutex> lock(state_->ring_mu);
  *overflowed = state_->head - *cursor > kRingSize;
  if (!*overflowed) {
    for (uint64_t i = *cursor; i < state_->head; ++i) out->push_back(state_->ring[i % kRingSize]);
  }
  *cursor = state_->head;
}

}  // namespace tf_rdma::verbs
