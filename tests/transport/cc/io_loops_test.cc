// The I/O loop's promise to a handler that returned kMore: it is called again with EPOLLIN, even
// when the next event for its descriptor is one without it (the socket became writable). A stream
// connection that ended its turn with frames left in its reader's buffer has nothing new in the
// socket, so no later event would bring them back to it.
#include "cc/transport/io_loops.h"

#include <gtest/gtest.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <memory>

namespace tf_rdma {
namespace {

// Reads the one byte its peer sends and says work is left, while asking for writable events: the
// next event for its socket is writable only. Records the events of the call after that.
class WorkLeftOverHandler : public IoHandler {
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
  bool OnTick(absl::Time) override { return true; }
  void OnLoopStopped() override {}
  void OnRemoved() override {}

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

}  // namespace
}  // namespace tf_rdma
