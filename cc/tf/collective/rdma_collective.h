// The collective transport of tf_rdma's server protocol: a collective's buffer (a chunk of an
// all-reduce, a gather's piece, a broadcast) that crosses to another task between CPU devices
// moves over tf_rdma. The provider pushes its buffer once into the range the consumer granted for
// that key when its receive started; GPU ends stay on gRPC's RecvBuf, counted with that reason.
#ifndef TF_RDMA_CC_TF_COLLECTIVE_RDMA_COLLECTIVE_H_
#define TF_RDMA_CC_TF_COLLECTIVE_RDMA_COLLECTIVE_H_

#include <memory>
#include <string>

#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/distributed_runtime/rpc_collective_executor_mgr.h"

namespace tf_rdma {

std::unique_ptr<tensorflow::RpcCollectiveExecutorMgr> NewRdmaCollectiveExecutorMgr(
    const tensorflow::ConfigProto& config, const tensorflow::DeviceMgr* device_mgr,
    tensorflow::WorkerCacheInterface* worker_cache, const std::string& task_name,
    std::shared_ptr<Runtime> runtime);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_COLLECTIVE_RDMA_COLLECTIVE_H_
