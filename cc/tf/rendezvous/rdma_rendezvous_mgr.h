// The remote rendezvous of tf_rdma's server protocol: every tensor that crosses from this task to
// another between CPU devices (graph partitions, multi-device functions, eager copies) moves over
// tf_rdma. The sender pushes: its Send writes the tensor once, straight from the tensor's memory,
// into the range the receiver granted for that transfer (the receiver grants when its Recv runs, so
// in the steady state the bytes find their destination waiting). Transfers with a GPU end stay on
// TensorFlow's own gRPC rendezvous, counted with that reason.
#ifndef TF_RDMA_CC_TF_RENDEZVOUS_RDMA_RENDEZVOUS_MGR_H_
#define TF_RDMA_CC_TF_RENDEZVOUS_RDMA_RENDEZVOUS_MGR_H_

#include <memory>

#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/distributed_runtime/rpc/rpc_rendezvous_mgr.h"

namespace tf_rdma {

class EndedSteps;  // ended_steps.h

class RdmaRendezvousMgr : public tensorflow::RpcRendezvousMgr {
 public:
  RdmaRendezvousMgr(const tensorflow::WorkerEnv* env, std::shared_ptr<Runtime> runtime);
  ~RdmaRendezvousMgr() override;

  // The step's owner is done with it. Unlike the base manager, this aborts the step's rendezvous
  // only if something still holds it a while later (see EndedSteps).
  void Cleanup(int64_t step_id) override;
  void CleanupAll() override;

 protected:
  tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> Create(
      int64_t step_id, const tensorflow::WorkerEnv* worker_env) override;

 private:
  const std::shared_ptr<Runtime> runtime_;
  const std::shared_ptr<EndedSteps> steps_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RENDEZVOUS_RDMA_RENDEZVOUS_MGR_H_
