// The I/O loop's promises to a handler: after kMore it is called again with EPOLLIN, even when the
// next event for its descriptor is one without it (the socket became writable), because a stream
// connection that ended its turn with frames left in its reader's buffer has nothing new in the
// socket, so no later event would bring them back to it. And after serving an event the loop polls
// for its poll window, then sleeps.
#include "cc/transport/io_loops.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <thread>

namespace tf_rdma {
namespace {

// A handler that needs nothing of ticks or the loop's end.
class EventsOnlyHandler : public IoHandler {
 public:
  bool OnTick(absl::Time) override { return true; }
  void OnLoopStopped() override {}
  void OnRemoved() override {}
};

// Reads the one byte its peer sends and says work is left, while asking for writable events: the
// next event for its socket is writable only. Records the events of the call after that.
class WorkLeftOverHandler : public EventsOnlyHandler {
 public:
  WorkLeftOverHandler(int fd, IoLoop* loop) : fd_(fd), loop_(loop) {}
  ~WorkLeftOverHandler() override { close(fd_); }

  Progress OnEvents(uint32_t events) override {
    if (calls_++ == 0) {
      char byte;
      EXPECT_EQ(read(fd_, &byte, 1), 1);
      loop_->WatchWritable(fd_, this, true);
      return Progress::kMore;
    }
    loop_->WatchWritable(fd_, this, false);
    if (calls_ == 2) next_call_events_.set_value(events);
    return Progress::kWaiting;
  }

  std::future<uint32_t> NextCallEvents() { return next_call_events_.get_future(); }

 private:
  const int fd_;
  IoLoop* const loop_;
  int calls_ = 0;
  std::promise<uint32_t> next_call_events_;
};

TEST(IoLoopTest, AHandlerWithWorkLeftIsCalledWithEpollinWhenOnlyWritabilityIsReported) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
  IoLoops loops(1, absl::Milliseconds(100));
  ASSERT_TRUE(loops.Start().ok());
  absl::StatusOr<std::shared_ptr<IoLoop>> loop = loops.Next();
  ASSERT_TRUE(loop.ok());
  auto handler = std::make_shared<WorkLeftOverHandler>(fds[0], loop->get());
  std::future<uint32_t> events = handler->NextCallEvents();
  ASSERT_TRUE((*loop)->Add(fds[0], handler).ok());

  ASSERT_EQ(write(fds[1], "x", 1), 1);
  ASSERT_EQ(events.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_TRUE(events.get() & EPOLLIN) << "the bytes it had read were forgotten";
  close(fds[1]);
}

// Reads what comes and tells the test which clock counts its loop thread's CPU time.
class ThreadClockHandler : public EventsOnlyHandler {
 public:
  explicit ThreadClockHandler(int fd) : fd_(fd) {}
  ~ThreadClockHandler() override { close(fd_); }

  Progress OnEvents(uint32_t) override {
    char byte;
    while (read(fd_, &byte, 1) == 1) {
    }
    if (!told_) {
      told_ = true;
      clockid_t clock;
      pthread_getcpuclockid(pthread_self(), &clock);
      loop_thread_clock_.set_value(clock);
    }
    return Progress::kWaiting;
  }

  std::future<clockid_t> LoopThreadClock() { return loop_thread_clock_.get_future(); }

 private:
  const int fd_;
  bool told_ = false;
  std::promise<clockid_t> loop_thread_clock_;
};

absl::Duration CpuTime(clockid_t clock) {
  timespec now{};
  clock_gettime(clock, &now);
  return absl::DurationFromTimespec(now);
}

// The CPU time a loop's thread spends in the 300 ms after it served one byte, and in the 300 ms
// that start 500 ms after it.
std::pair<absl::Duration, absl::Duration> LoopCpuAfterAnEvent(absl::Duration poll_window) {
  int fds[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
  IoLoops loops(1, absl::Seconds(10), poll_window);
  EXPECT_TRUE(loops.Start().ok());
  absl::StatusOr<std::shared_ptr<IoLoop>> loop = loops.Next();
  EXPECT_TRUE(loop.ok());
  auto handler = std::make_shared<ThreadClockHandler>(fds[0]);
  std::future<clockid_t> clock_future = handler->LoopThreadClock();
  EXPECT_TRUE((*loop)->Add(fds[0], handler).ok());
  EXPECT_EQ(write(fds[1], "x", 1), 1);
  EXPECT_EQ(clock_future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const clockid_t clock = clock_future.get();
  const absl::Duration start = CpuTime(clock);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const absl::Duration window_end = CpuTime(clock);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const absl::Duration later = CpuTime(clock);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const absl::Duration later_end = CpuTime(clock);
  close(fds[1]);
  return {window_end - start, later_end - later};
}

TEST(IoLoopTest, AfterAnEventTheLoopPollsForItsWindowThenSleeps) {
  cpu_set_t cores;
  ASSERT_EQ(sched_getaffinity(0, sizeof(cores), &cores), 0);
  if (CPU_COUNT(&cores) == 1) GTEST_SKIP() << "confined to one core, where loops do not poll (taskset)";
  const auto [in_window, after_window] = LoopCpuAfterAnEvent(absl::Milliseconds(300));
  EXPECT_GE(in_window, absl::Milliseconds(30)) << "the loop slept instead of polling";
  EXPECT_LE(after_window, absl::Milliseconds(20)) << "the loop kept polling past its window";
}

TEST(IoLoopTest, ALoopConfinedToOneCoreDoesNotPoll) {
  // The loop's thread inherits this thread's cores when it starts.
  cpu_set_t all, one;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &all)) {
      CPU_SET(cpu, &one);
      break;
    }
  }
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  const auto [in_window, after_window] = LoopCpuAfterAnEvent(absl::Milliseconds(300));
  ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);
  EXPECT_LE(in_window, absl::Milliseconds(20)) << "a loop held to one core polled";
  EXPECT_LE(after_window, absl::Milliseconds(20));
}

TEST(IoLoopTest, WithNoPollWindowTheLoopSleepsAtOnce) {
  const auto [in_window, after_window] = LoopCpuAfterAnEvent(absl::ZeroDuration());
  EXPECT_LE(in_window, absl::Milliseconds(20)) << "the loop polled with no window";
  EXPECT_LE(after_window, absl::Milliseconds(20));
}

}  // namespace
}  // namespace tf_rdma
