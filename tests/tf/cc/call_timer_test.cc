// The process's call timer (cc/tf/calls/call_timer.h): closures run in the order of their times,
// all on its one thread however many were scheduled, and a cancelled one never runs.
#include "cc/tf/calls/call_timer.h"

#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"

namespace tf_rdma {
namespace {

TEST(CallTimerTest, ClosuresRunInTimeOrderOnOneThreadAndCancelledOnesNever) {
  CallTimer& timer = CallTimer::Process();
  std::mutex mu;
  std::vector<int> ran;
  std::set<std::thread::id> threads;
  const absl::Time start = absl::Now();
  absl::Notification last;
  std::vector<uint64_t> ids;
  // Scheduled in reverse: the timer, not the order of At, decides.
  for (int i = 40; i >= 0; --i) {
    ids.push_back(timer.At(start + absl::Milliseconds(5 * i), [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      ran.push_back(i);
      threads.insert(std::this_thread::get_id());
      if (i == 40) last.Notify();
    }));
  }
  timer.Cancel(ids[40 - 7]);  // the closure for 7
  ASSERT_TRUE(last.WaitForNotificationWithTimeout(absl::Seconds(20)));
  std::lock_guard<std::mutex> lock(mu);
  std::vector<int> expected;
  for (int i = 0; i <= 40; ++i) {
    if (i != 7) expected.push_back(i);
  }
  EXPECT_EQ(ran, expected);
  EXPECT_EQ(threads.size(), 1u);
}

TEST(CallTimerTest, APastTimeRunsAtOnce) {
  absl::Notification ran;
  CallTimer::Process().At(absl::InfinitePast(), [&ran] { ran.Notify(); });
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

}  // namespace
}  // namespace tf_rdma
