// RunGraph request ids of tf_rdma's own (cc/tf/calls/run_graph_ids.h): distinct however many
// threads take them (TensorFlow's master takes each step's in a thread of its own), never 0, in
// place of the id the master sets, in requests of the kind the wrapped worker creates.
#include "cc/tf/calls/run_graph_ids.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

namespace tf_rdma {
namespace {

using tensorflow::StatusCallback;

TEST(RunGraphIdsTest, IdsTakenOnFreshThreadsAreAllDistinctAndNeverZero) {
  constexpr int kThreads = 2000;
  constexpr int kIdsPerThread = 50;
  std::mutex mu;
  std::unordered_set<int64_t> ids;
  for (int i = 0; i < kThreads; ++i) {
    // One at a time, each in a thread that starts for it, as Master::RunStep runs each step.
    std::thread([&] {
      std::vector<int64_t> taken;
      for (int j = 0; j < kIdsPerThread; ++j) taken.push_back(NextRunGraphRequestId());
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(taken.begin(), taken.end());
    }).join();
  }
  EXPECT_EQ(ids.size(), size_t{kThreads} * kIdsPerThread);
  EXPECT_EQ(ids.count(0), 0u);
}

TEST(RunGraphIdsTest, ARequestTakesItsOwnIdForTheMastersAndCarriesItInItsProto) {
  RunGraphRequestWithOwnId<tensorflow::MutableProtoRunGraphRequest> first, second;
  first.set_request_id(7);
  second.set_request_id(7);
  EXPECT_NE(first.request_id(), 7);
  EXPECT_NE(first.request_id(), 0);
  EXPECT_NE(first.request_id(), second.request_id());
  EXPECT_EQ(first.ToProto().request_id(), first.request_id());
}

// A worker that creates requests of one kind and records the RunGraph requests it is given.
class RecordingWorker : public tensorflow::WorkerInterface {
 public:
  explicit RecordingWorker(bool in_memory) : in_memory_(in_memory) {}
  tensorflow::MutableRunGraphRequestWrapper* CreateRunGraphRequest() override {
    if (in_memory_) return new tensorflow::InMemoryRunGraphRequest;
    return new tensorflow::MutableProtoRunGraphRequest;
  }
  void RunGraphAsync(tensorflow::CallOptions*, tensorflow::RunGraphRequestWrapper* request,
                     tensorflow::MutableRunGraphResponseWrapper*, StatusCallback done) override {
    run_graph_requests.push_back(request);
    done(absl::OkStatus());
  }
  std::vector<tensorflow::RunGraphRequestWrapper*> run_graph_requests;

  void GetStatusAsync(tensorflow::CallOptions*, const tensorflow::GetStatusRequest*, tensorflow::GetStatusResponse*,
                      bool, StatusCallback done) override { Unused(done); }
  void CreateWorkerSessionAsync(const tensorflow::CreateWorkerSessionRequest*,
                                tensorflow::CreateWorkerSessionResponse*, StatusCallback done) override { Unused(done); }
  void DeleteWorkerSessionAsync(tensorflow::CallOptions*, const tensorflow::DeleteWorkerSessionRequest*,
                                tensorflow::DeleteWorkerSessionResponse*, StatusCallback done) override { Unused(done); }
  void RegisterGraphAsync(const tensorflow::RegisterGraphRequest*, tensorflow::RegisterGraphResponse*,
                          StatusCallback done) override { Unused(done); }
  void DeregisterGraphAsync(const tensorflow::DeregisterGraphRequest*, tensorflow::DeregisterGraphResponse*,
                            StatusCallback done) override { Unused(done); }
  void CleanupGraphAsync(const tensorflow::CleanupGraphRequest*, tensorflow::CleanupGraphResponse*,
                         StatusCallback done) override { Unused(done); }
  void CleanupAllAsync(const tensorflow::CleanupAllRequest*, tensorflow::CleanupAllResponse*,
                       StatusCallback done) override { Unused(done); }
  void RecvTensorAsync(tensorflow::CallOptions*, const tensorflow::RecvTensorRequest*, tensorflow::TensorResponse*,
                       StatusCallback done) override { Unused(done); }
  void LoggingAsync(const tensorflow::LoggingRequest*, tensorflow::LoggingResponse*,
                    StatusCallback done) override { Unused(done); }
  void TracingAsync(const tensorflow::TracingRequest*, tensorflow::TracingResponse*,
                    StatusCallback done) override { Unused(done); }
  void RecvBufAsync(tensorflow::CallOptions*, const tensorflow::RecvBufRequest*, tensorflow::RecvBufResponse*,
                    StatusCallback done) override { Unused(done); }
  void CompleteGroupAsync(tensorflow::CallOptions*, const tensorflow::CompleteGroupRequest*,
                          tensorflow::CompleteGroupResponse*, StatusCallback done) override { Unused(done); }
  void CompleteInstanceAsync(tensorflow::CallOptions*, const tensorflow::CompleteInstanceRequest*,
                             tensorflow::CompleteInstanceResponse*, StatusCallback done) override { Unused(done); }
  void GetStepSequenceAsync(const tensorflow::GetStepSequenceRequest*, tensorflow::GetStepSequenceResponse*,
                            StatusCallback done) override { Unused(done); }

 private:
  static void Unused(const StatusCallback& done) { done(absl::UnimplementedError("not used by this test")); }
  const bool in_memory_;
};

TEST(RunGraphIdsTest, TheWrappedWorkersRequestsAreOfItsKindWithOwnIdsAndReachIt) {
  for (bool in_memory : {true, false}) {
    RecordingWorker worker(in_memory);
    WorkerWithOwnRunGraphIds wrapped(&worker);
    std::unique_ptr<tensorflow::MutableRunGraphRequestWrapper> request(wrapped.CreateRunGraphRequest());
    EXPECT_EQ(dynamic_cast<tensorflow::InMemoryRunGraphRequest*>(request.get()) != nullptr, in_memory);
    EXPECT_EQ(dynamic_cast<tensorflow::MutableProtoRunGraphRequest*>(request.get()) != nullptr, !in_memory);
    request->set_request_id(7);
    EXPECT_NE(request->request_id(), 7);
    EXPECT_NE(request->request_id(), 0);

    std::unique_ptr<tensorflow::MutableRunGraphResponseWrapper> response(wrapped.CreateRunGraphResponse());
    absl::Status status = absl::UnknownError("not run");
    wrapped.RunGraphAsync(nullptr, request.get(), response.get(), [&](const absl::Status& s) { status = s; });
    EXPECT_TRUE(status.ok()) << status;
    ASSERT_EQ(worker.run_graph_requests.size(), 1u);
    EXPECT_EQ(worker.run_graph_requests[0], request.get());
    wrapped.CleanupGraphAsync(nullptr, nullptr, [&](const absl::Status& s) { status = s; });
    EXPECT_TRUE(absl::IsUnimplemented(status)) << status;
  }
}

}  // namespace
}  // namespace tf_rdma
