#include "cc/transport/io_loops.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <system_error>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cc/transport/errno_message.h"

namespace tf_rdma {

namespace {

bool MayRunOnOneCoreOnly() {
  cpu_set_t cores;
  CPU_ZERO(&cores);
  return sched_getaffinity(0, sizeof(cores), &cores) == 0 && CPU_COUNT(&cores) == 1;
}

}  // namespace

IoLoop::IoLoop(int epoll_fd, int wake_fd, absl::Duration tick, absl::Duration poll_window)
    : epoll_fd_(epoll_fd), wake_fd_(wake_fd), tick_(tick), poll_window_(poll_window) {}

IoLoop::~IoLoop() {
  close(wake_fd_);
  close(epoll_fd_);
}

absl::Status IoLoop::Add(int fd, std::shared_ptr<IoHandler> handler) {
  IoHandler* key = handler.get();
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return absl::CancelledError("the local tf_rdma transport shut down");
  handlers_.emplace(key, std::make_pair(fd, std::move(handler)));
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.ptr = key;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
    const int error = errno;
    handlers_.erase(key);
    return absl::ResourceExhaustedError(ErrnoMessage("epoll_ctl(EPOLL_CTL_ADD)", error));
  }
  return absl::OkStatus();
}

void IoLoop::WatchWritable(int fd, IoHandler* handler, bool writable) {
  epoll_event event{};
  event.events = writable ? EPOLLIN | EPOLLOUT : EPOLLIN;
  event.data.ptr = handler;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &event);  // ENOENT once removed: nothing to watch
}

void IoLoop::Remove(IoHandler* handler) {
  std::shared_ptr<IoHandler> removed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handlers_.find(handler);
    if (it == handlers_.end()) return;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.first, nullptr);
    removed = std::move(it->second.second);
    handlers_.erase(it);
  }
  // Outside the lock: the handler takes its own locks, and its destructor may run here.
  removed->OnRemoved();
}

void IoLoop::Run() {
  // Throwing std::bad_alloc needs libstdc++'s per-thread exception state, which the loader
  // allocates on first use and, failing that, ends the process (_exit(127)). Used once now,
  // while the thread's creation shows there is memory, a later bad_alloc (a peer's frames, see
  // StreamConnection::ReadStep) can be thrown and caught. (Declared pure: only a volatile
  // destination keeps the call from being optimized away.)
  volatile int exceptions_in_flight = std::uncaught_exceptions();
  (void)exceptions_in_flight;
  constexpr int kBatch = 64;
  epoll_event events[kBatch];
  absl::Time next_tick = absl::Now() + tick_;
  std::vector<IoHandler*> finished;
  // Handlers with work left over from their last call, served again after the next poll.
  std::vector<IoHandler*> more;
  std::vector<IoHandler*> again;
  absl::Time poll_until = absl::InfinitePast();
  // A thread held to one core polls not at all: it would keep that core from the very peer, or
  // the other threads of this process, whose work it waits for (measured with both ends on one
  // core: a hop took the whole window). Yielding the core while polling helps there, but lets
  // any other runnable task, even an idle-priority one, hold the core past the answer.
  const absl::Duration poll_window = MayRunOnOneCoreOnly() ? absl::ZeroDuration() : poll_window_;
  while (!stopping_) {
    const absl::Time before = absl::Now();
    const bool polling = before < poll_until;
    const int timeout_ms = !more.empty() || polling
                               ? 0
                               : std::max<int64_t>(0, absl::ToInt64Milliseconds(next_tick - before) + 1);
    int ready = epoll_wait(epoll_fd_, events, kBatch, timeout_ms);
    if (ready < 0) {
      if (errno != EINTR) {
        LOG(ERROR) << "tf_rdma: epoll_wait failed: " << ErrnoMessage("epoll_wait", errno)
                   << "; this I/O thread's connections stop";
        break;
      }
      ready = 0;
    }
    finished.clear();
    again.clear();
    bool served = !more.empty();
    auto serve = [&](IoHandler* handler, uint32_t what) {
      if (std::find(finished.begin(), finished.end(), handler) != finished.end()) return;
      switch (handler->OnEvents(what)) {
        case IoHandler::Progress::kWaiting: break;
        case IoHandler::Progress::kMore: again.push_back(handler); break;
        case IoHandler::Progress::kFinished: finished.push_back(handler); break;
      }
    };
    for (int i = 0; i < ready; ++i) {
      auto* handler = static_cast<IoHandler*>(events[i].data.ptr);
      if (handler == nullptr) {
        uint64_t count;
        (void)!read(wake_fd_, &count, sizeof(count));
        continue;
      }
      served = true;
      // A handler with work left is called as it would have been below, plus what the event
      // says: an event without EPOLLIN (writable only) must not make it forget bytes it read
      // already, which no later event announces.
      const auto left_over = std::remove(more.begin(), more.end(), handler);
      const uint32_t had_work_left = left_over != more.end() ? EPOLLIN : 0;
      more.erase(left_over, more.end());
      serve(handler, events[i].events | had_work_left);
    }
    for (IoHandler* handler : more) serve(handler, EPOLLIN);
    more.swap(again);
    for (IoHandler* handler : finished) {
      more.erase(std::remove(more.begin(), more.end(), handler), more.end());
      Remove(handler);
    }
    const absl::Time now = absl::Now();
    if (served) poll_until = now + poll_window;
    if (now >= next_tick) {
      next_tick = now + tick_;
      std::vector<std::shared_ptr<IoHandler>> all;
      {
        std::lock_guard<std::mutex> lock(mu_);
        all.reserve(handlers_.size());
        for (const auto& [key, entry] : handlers_) all.push_back(entry.second);
      }
      for (const auto& handler : all) {
        if (handler->OnTick(now)) continue;
        more.erase(std::remove(more.begin(), more.end(), handler.get()), more.end());
        Remove(handler.get());
      }
    }
  }
  std::unordered_map<IoHandler*, std::pair<int, std::shared_ptr<IoHandler>>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    left.swap(handlers_);
  }
  for (auto& [key, entry] : left) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, entry.first, nullptr);
    entry.second->OnLoopStopped();
    entry.second->OnRemoved();
  }
}

void IoLoop::Stop() {
  stopping_ = true;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

IoLoops::~IoLoops() {
  for (auto& loop : loops_) loop->Stop();
  for (auto& thread : threads_running_) thread.join();
}

absl::Status IoLoops::StartLocked() {
  while (loops_.size() < threads_) {
    const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd < 0) return absl::ResourceExhaustedError(ErrnoMessage("epoll_create1", errno));
    const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd < 0) {
      const int error = errno;
      close(epoll_fd);
      return absl::ResourceExhaustedError(ErrnoMessage("eventfd", error));
    }
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.ptr = nullptr;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &event);
    auto loop = std::make_shared<IoLoop>(epoll_fd, wake_fd, tick_, poll_window_);
    try {
      threads_running_.emplace_back([loop] { loop->Run(); });
    } catch (const std::system_error& error) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot start a tf_rdma I/O thread: ", error.what()));
    }
    loops_.push_back(std::move(loop));
  }
  return absl::OkStatus();
}

absl::Status IoLoops::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  return StartLocked();
}

absl::StatusOr<std::shared_ptr<IoLoop>> IoLoops::Next() {
  std::lock_guard<std::mutex> lock(mu_);
  // Fewer loops than asked for (threads ran short earlier) serve rather than no connection.
  const absl::Status started = StartLocked();
  if (loops_.empty()) return started;
  return loops_[next_++ % loops_.size()];
}

}  // namespace tf_rdma
