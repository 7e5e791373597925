#include "cc/transport/fork_guard.h"

#include <pthread.h>

#include <atomic>

namespace tf_rdma {
namespace {

std::atomic<pid_t>& Pid() {
  static std::atomic<pid_t> pid{getpid()};
  return pid;
}

void RefreshPid() { Pid().store(getpid(), std::memory_order_relaxed); }

}  // namespace

pid_t CurrentPid() {
  static const bool renewed_on_fork = pthread_atfork(nullptr, nullptr, &RefreshPid) == 0;
  return renewed_on_fork ? Pid().load(std::memory_order_relaxed) : getpid();
}

}  // namespace tf_rdma
