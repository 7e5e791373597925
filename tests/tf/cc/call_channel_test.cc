// Control calls over a real connection of each backend (cc/tf/calls/call_channel.h): replies of
// every size reach their caller exactly once, errors keep their code and message, a cancellation
// reaches the serving side, a connection's end fails the calls in flight as kUnavailable naming the
// peer, and what a peer can make the serving side spend is bounded.
#include "cc/tf/calls/call_channel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "cc/tf/messages/call_message.h"

namespace tf_rdma {
namespace {

constexpr uint8_t kEcho = 1;      // replies with the request twice
constexpr uint8_t kFail = 2;      // replies NOT_FOUND with the request as the message
constexpr uint8_t kHold = 3;      // replies when the test says so
constexpr uint8_t kCounted = 4;   // counts the request, echoes it from another thread (as a pool)

// A call's outcome, once it came.
struct Outcome {
  absl::Notification came;
  absl::Status status;
  std::string reply;
  std::atomic<int> times{0};
};

OutgoingCall::ReplyDone Into(Outcome& outcome) {
  return [&outcome](const absl::Status& status, std::string_view reply) {
    outcome.status = status;
    outcome.reply = std::string(reply);
    if (outcome.times.fetch_add(1) == 0) outcome.came.Notify();
  };
}

bool Await(Outcome& outcome) { return outcome.came.WaitForNotificationWithTimeout(absl::Seconds(20)); }

std::string Pattern(size_t bytes, char seed) {
  std::string out(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<char>(seed + i * 7);
  return out;
}

class CallChannelTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { Connect(CallLimits{}); }
  void TearDown() override { Disconnect(); }

  // Connections first, then their transports; the calls held end with them.
  void Disconnect() {
    if (client_) client_->connection()->Close(absl::CancelledError("the test ended"));
    if (served_connection_) served_connection_->Close(absl::CancelledError("the test ended"));
    std::lock_guard<std::mutex> lock(mu_);
    held_.clear();
    client_.reset();
    served_connection_.reset();
    listener_.reset();
    calling_.reset();
    serving_.reset();
  }

  void Connect(CallLimits server_limits) {
    Disconnect();
    TransportOptions options;
    options.cluster_key = std::string(32, 'k');
    options.peer_timeout = absl::Seconds(5);
    options.local_name = "serving";
    absl::StatusOr<std::unique_ptr<Transport>> serving = CreateTransport(GetParam(), options);
    options.local_name = "calling";
    absl::StatusOr<std::unique_ptr<Transport>> calling = CreateTransport(GetParam(), options);
    ASSERT_TRUE(serving.ok()) << serving.status();
    ASSERT_TRUE(calling.ok()) << calling.status();
    serving_ = *std::move(serving);
    calling_ = *std::move(calling);
    std::promise<std::shared_ptr<Connection>> accepted;
    absl::StatusOr<std::unique_ptr<Listener>> listener = serving_->Listen(
        Endpoint{"127.0.0.1", 0}, [&accepted](std::shared_ptr<Connection> c) { accepted.set_value(std::move(c)); },
        nullptr);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *std::move(listener);
    absl::StatusOr<std::shared_ptr<Connection>> dialed = calling_->Connect(listener_->endpoint());
    ASSERT_TRUE(dialed.ok()) << dialed.status();
    served_connection_ = accepted.get_future().get();
    auto serving_pool = std::make_shared<BufferPool>(serving_.get(), 1 << 20, 64 << 20);
    ASSERT_TRUE(CallServer::Start(served_connection_, *serving_, serving_pool, server_limits,
                                  [this](std::shared_ptr<ServedCall> call) { Serve(std::move(call)); })
                    .ok());
    client_ = std::make_shared<CallClient>(*dialed, std::make_shared<BufferPool>(calling_.get(), 1 << 20, 64 << 20),
                                           CallLimits{});
  }

  void Serve(std::shared_ptr<ServedCall> call) {
    if (call->method() == kCounted) {
      std::lock_guard<std::mutex> lock(mu_);
      ++served_[call->request()];
      queued_.push_back(std::move(call));
      held_changed_.notify_all();
      return;
    }
    if (call->method() == kEcho) {
      call->Reply(absl::OkStatus(), call->request() + call->request());
    } else if (call->method() == kFail) {
      absl::Status status = absl::NotFoundError(call->request());
      status.SetPayload("type.googleapis.com/tensorflow.DerivedStatus", absl::Cord("derived"));
      call->Reply(status, {});
    } else {
      call->SetCancelCallback([this] { ++cancelled_; });
      std::lock_guard<std::mutex> lock(mu_);
      held_.push_back(std::move(call));
      held_changed_.notify_all();
    }
  }

  std::shared_ptr<ServedCall> AwaitHeld(size_t index) {
    std::unique_lock<std::mutex> lock(mu_);
    held_changed_.wait_for(lock, std::chrono::seconds(20), [&] { return held_.size() > index; });
    return held_.size() > index ? held_[index] : nullptr;
  }

  // Replies to the kCounted calls queued, on a thread of its own, until `stop`.
  void ReplyToQueued(const std::atomic<bool>& stop) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop.load()) {
      held_changed_.wait_for(lock, std::chrono::milliseconds(10), [&] { return !queued_.empty(); });
      std::vector<std::shared_ptr<ServedCall>> due;
      due.swap(queued_);
      lock.unlock();
      for (auto& call : due) call->Reply(absl::OkStatus(), call->request());
      lock.lock();
    }
  }

  std::unique_ptr<Transport> serving_;
  std::unique_ptr<Transport> calling_;
  std::unique_ptr<Listener> listener_;
  std::shared_ptr<Connection> served_connection_;
  std::shared_ptr<CallClient> client_;
  std::atomic<int> cancelled_{0};
  std::mutex mu_;
  std::condition_variable held_changed_;
  std::vector<std::shared_ptr<ServedCall>> held_;
  std::vector<std::shared_ptr<ServedCall>> queued_;
  std::map<std::string, int> served_;  // how often each kCounted request was served
};

TEST(CleanupStepsTest, StepIdsComeBackAsSentAndARequestOutOfBoundsIsRefused) {
  const std::vector<int64_t> step_ids = {1, -1, 0, int64_t{1} << 62, -(int64_t{1} << 63), 85668367723381541};
  const std::string bytes = EncodeCleanupSteps(step_ids);
  EXPECT_EQ(bytes.size(), 8 * step_ids.size());
  absl::StatusOr<std::vector<int64_t>> decoded = DecodeCleanupSteps(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, step_ids);
  const std::vector<int64_t> most(kMaxCleanupSteps, 7);
  EXPECT_TRUE(DecodeCleanupSteps(EncodeCleanupSteps(most)).ok());
  for (const std::string& bad : {std::string(), bytes.substr(0, 7), bytes + "x",
                                 EncodeCleanupSteps(std::vector<int64_t>(kMaxCleanupSteps + 1, 7))}) {
    absl::StatusOr<std::vector<int64_t>> refused = DecodeCleanupSteps(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << bad.size() << " bytes: " << refused.status();
  }
}

TEST_P(CallChannelTest, RequestsAndRepliesOfEverySizeArriveWhole) {
  // Empty, inline, the slot's edge either side, a body of its own, and replies past the first grant.
  const uint64_t edge = kCallRequestSlotBytes - kCallRequestHeaderBytes;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{100}, edge, edge + 1, size_t{3 << 20}}) {
    const std::string request = Pattern(bytes, static_cast<char>(bytes));
    Outcome outcome;
    client_->Call(kEcho, request, Into(outcome));
    ASSERT_TRUE(Await(outcome)) << bytes;
    ASSERT_TRUE(outcome.status.ok()) << bytes << ": " << outcome.status;
    EXPECT_EQ(outcome.reply, request + request) << bytes;
    EXPECT_EQ(outcome.times.load(), 1);
  }
}

TEST_P(CallChannelTest, ManyCallsInFlightEachGetTheirOwnReply) {
  constexpr int kCalls = 300;
  std::vector<std::unique_ptr<Outcome>> outcomes;
  for (int i = 0; i < kCalls; ++i) {
    outcomes.push_back(std::make_unique<Outcome>());
    client_->Call(kEcho, Pattern(i * 61, static_cast<char>(i)), Into(*outcomes.back()));
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(Await(*outcomes[i])) << i;
    ASSERT_TRUE(outcomes[i]->status.ok()) << outcomes[i]->status;
    const std::string request = Pattern(i * 61, static_cast<char>(i));
    EXPECT_EQ(outcomes[i]->reply, request + request) << i;
  }
}

TEST_P(CallChannelTest, CallsFromSeveralThreadsRepliedFromAnotherAreEachServedOnce) {
  // As a master's steps and their cleanups call a ps: callers on several threads, each waiting for
  // its reply, the replies written from another thread than the one that read the requests.
  constexpr int kThreads = 3;
  constexpr int kCallsEach = 1500;
  std::atomic<bool> stop{false};
  std::thread replier([&] { ReplyToQueued(stop); });
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < kThreads; ++t) {
    callers.emplace_back([&, t] {
      for (int n = 0; n < kCallsEach; ++n) {
        // Sizes either side of what a request slot holds, so that some bodies travel apart.
        const std::string request = absl::StrCat("caller ", t, " call ", n, " ",
                                                 std::string(n % 7 == 0 ? kCallRequestSlotBytes : n % 97, 'x'));
        Outcome outcome;
        client_->Call(kCounted, request, Into(outcome));
        if (!Await(outcome) || !outcome.status.ok() || outcome.reply != request || outcome.times.load() != 1) {
          ++wrong;
        }
      }
    });
  }
  for (auto& caller : callers) caller.join();
  stop = true;
  replier.join();
  EXPECT_EQ(wrong.load(), 0);
  std::lock_guard<std::mutex> lock(mu_);
  EXPECT_EQ(served_.size(), size_t{kThreads * kCallsEach});
  for (const auto& [request, times] : served_) EXPECT_EQ(times, 1) << request.substr(0, 30);
}

TEST_P(CallChannelTest, AnErrorKeepsItsCodeMessageAndPayloads) {
  Outcome outcome;
  client_->Call(kFail, "no graph with handle 7", Into(outcome));
  ASSERT_TRUE(Await(outcome));
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(outcome.status.message(), "no graph with handle 7");
  EXPECT_EQ(outcome.status.GetPayload("type.googleapis.com/tensorflow.DerivedStatus"), absl::Cord("derived"));
}

TEST_P(CallChannelTest, ACancelledCallEndsOnceAndTheServingSideIsTold) {
  Outcome outcome;
  std::shared_ptr<OutgoingCall> call = client_->Call(kHold, "step 1", Into(outcome));
  std::shared_ptr<ServedCall> served = AwaitHeld(0);
  ASSERT_NE(served, nullptr);
  call->Cancel(absl::CancelledError("the session closed"));
  ASSERT_TRUE(Await(outcome));
  EXPECT_EQ(outcome.status, absl::CancelledError("the session closed"));
  for (int i = 0; i < 2000 && cancelled_.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(cancelled_.load(), 1);
  served->Reply(absl::OkStatus(), "too late");  // goes nowhere
  Outcome next;
  client_->Call(kEcho, "after", Into(next));
  ASSERT_TRUE(Await(next));
  EXPECT_EQ(next.reply, "afterafter");
  EXPECT_EQ(outcome.times.load(), 1);
}

TEST_P(CallChannelTest, TheConnectionsEndFailsCallsInFlightNamingThePeer) {
  Outcome outcome;
  client_->Call(kHold, "step 1", Into(outcome));
  ASSERT_NE(AwaitHeld(0), nullptr);
  served_connection_->Close(absl::AbortedError("the serving task stopped"));
  ASSERT_TRUE(Await(outcome));
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kUnavailable) << outcome.status;
  EXPECT_NE(outcome.status.message().find("serving"), std::string::npos) << outcome.status;
  EXPECT_EQ(cancelled_.load(), 1);
  Outcome after;
  client_->Call(kEcho, "x", Into(after));
  ASSERT_TRUE(Await(after));
  EXPECT_EQ(after.status.code(), absl::StatusCode::kUnavailable) << after.status;
}

TEST_P(CallChannelTest, CallsPastTheLimitInFlightAreRefusedAndLaterOnesServed) {
  Connect(CallLimits{1 << 20, 2});
  Outcome first, second, third;
  client_->Call(kHold, "1", Into(first));
  client_->Call(kHold, "2", Into(second));
  ASSERT_NE(AwaitHeld(1), nullptr);
  client_->Call(kHold, "3", Into(third));
  ASSERT_TRUE(Await(third));
  EXPECT_EQ(third.status.code(), absl::StatusCode::kResourceExhausted) << third.status;
  EXPECT_NE(third.status.message().find("TF_RDMA_MAX_CALLS_PER_PEER"), std::string::npos) << third.status;
  AwaitHeld(0)->Reply(absl::OkStatus(), "one");
  AwaitHeld(1)->Reply(absl::OkStatus(), "two");
  ASSERT_TRUE(Await(first) && Await(second));
  EXPECT_EQ(first.reply, "one");
  Outcome fourth;
  client_->Call(kEcho, "4", Into(fourth));
  ASSERT_TRUE(Await(fourth));
  EXPECT_EQ(fourth.reply, "44");
}

TEST_P(CallChannelTest, ARequestOverTheServingSidesLimitIsRefusedAndTheConnectionLives) {
  Connect(CallLimits{1 << 20, 16});
  Outcome big;
  client_->Call(kEcho, std::string((1 << 20) + 1, 'b'), Into(big));
  ASSERT_TRUE(Await(big));
  EXPECT_EQ(big.status.code(), absl::StatusCode::kResourceExhausted) << big.status;
  EXPECT_NE(big.status.message().find("TF_RDMA_MAX_CALL_BYTES"), std::string::npos) << big.status;
  Outcome small;
  client_->Call(kEcho, "s", Into(small));
  ASSERT_TRUE(Await(small));
  EXPECT_EQ(small.reply, "ss");
}

TEST_P(CallChannelTest, RequestsInFlightHoldNoMoreThanTheLimitTogether) {
  Connect(CallLimits{1 << 20, 16});
  const std::string body(600 << 10, 'h');
  Outcome held, refused;
  client_->Call(kHold, body, Into(held));
  ASSERT_NE(AwaitHeld(0), nullptr);
  client_->Call(kEcho, body, Into(refused));
  ASSERT_TRUE(Await(refused));
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("TF_RDMA_MAX_CALL_BYTES"), std::string::npos) << refused.status;
  AwaitHeld(0)->Reply(absl::OkStatus(), "done");
  ASSERT_TRUE(Await(held));
  Outcome after;
  client_->Call(kEcho, body, Into(after));
  ASSERT_TRUE(Await(after));
  EXPECT_TRUE(after.status.ok()) << after.status;
  EXPECT_EQ(after.reply, body + body);
}

TEST_P(CallChannelTest, APeerThatReadsNoneOfTheAnswersToItsDeclinedCallsIsDisconnected) {
  // Each request announces a body past the limit and the caller grants no reply: every answer
  // would wait for a grant that never comes.
  Connect(CallLimits{1 << 20, 2});
  for (uint64_t id = 1; id <= 3; ++id) {
    const std::string request =
        EncodeCallRequest(CallRequestHeader{CallFrame::kRequest, kEcho, id, (1 << 20) + 1}, {});
    std::promise<absl::Status> written;
    client_->connection()->Write(CallRequestTag(), request.data(), request.size(),
                                 [&written](const absl::Status& status) { written.set_value(status); });
    EXPECT_TRUE(written.get_future().get().ok());
  }
  for (int i = 0; i < 2000 && served_connection_->health().ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(served_connection_->health().code(), absl::StatusCode::kDataLoss) << served_connection_->health();
  EXPECT_NE(served_connection_->health().message().find("unread"), std::string::npos) << served_connection_->health();
}

TEST_P(CallChannelTest, ABadRequestMessageEndsTheConnectionNamingTheProtocol) {
  const std::string garbage(64, 'g');
  std::promise<absl::Status> written;
  client_->connection()->Write(CallRequestTag(), garbage.data(), garbage.size(),
                               [&written](const absl::Status& status) { written.set_value(status); });
  EXPECT_TRUE(written.get_future().get().ok());
  for (int i = 0; i < 2000 && served_connection_->health().ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(served_connection_->health().code(), absl::StatusCode::kDataLoss) << served_connection_->health();
  EXPECT_NE(served_connection_->health().message().find("broke the tf_rdma protocol"), std::string::npos)
      << served_connection_->health();
}

INSTANTIATE_TEST_SUITE_P(EveryStreamBackend, CallChannelTest, ::testing::Values(Backend::kTcp, Backend::kShm),
                         [](const ::testing::TestParamInfo<Backend>& info) { return BackendName(info.param); });

}  // namespace
}  // namespace tf_rdma
