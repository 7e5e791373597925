#include "cc/tf/rendezvous/rdma_rendezvous_mgr.h"

#include <utility>

#include "cc/tf/rendezvous/ended_steps.h"
#include "cc/tf/rendezvous/rdma_remote_rendezvous.h"

namespace tf_rdma {

RdmaRendezvousMgr::RdmaRendezvousMgr(const tensorflow::WorkerEnv* env, std::shared_ptr<Runtime> runtime)
    : RpcRendezvousMgr(env), runtime_(std::move(runtime)), steps_(std::make_shared<EndedSteps>()) {}

RdmaRendezvousMgr::~RdmaRendezvousMgr() = default;

void RdmaRendezvousMgr::Cleanup(int64_t step_id) {
  // For a step no longer held the base cleanup only drops its cache entry.
  if (!steps_->Ended(step_id)) RpcRendezvousMgr::Cleanup(step_id);
  for (int64_t overdue : steps_->TakeOverdue()) RpcRendezvousMgr::Cleanup(overdue);
}

void RdmaRendezvousMgr::CleanupAll() {
  steps_->Clear();
  RpcRendezvousMgr::CleanupAll();
}

tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> RdmaRendezvousMgr::Create(
    int64_t step_id, const tensorflow::WorkerEnv* worker_env) {
  auto* rendezvous =
      new RdmaRemoteRendezvous(worker_env, step_id, runtime_, RpcRendezvousMgr::Create(step_id, worker_env));
  steps_->Started(step_id, rendezvous);
  return tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous>(rendezvous);
}

}  // namespace tf_rdma
