// tf_rdma's TensorFlow server protocol, "grpc+tf_rdma": TensorFlow's gRPC server, with the remote
// rendezvous, the collective transport and the worker- and eager-service calls between tasks
// replaced by tf_rdma's (cc/tf/rendezvous/, cc/tf/collective/, cc/tf/calls/). gRPC keeps the master
// service (a client's session calls). Registered
// with TensorFlow's ServerFactory when the extension loads, so tf.distribute.Server(protocol=...),
// connect_to_cluster(protocol=...) and a cluster resolver's rpc_layer all reach it.
#ifndef TF_RDMA_CC_TF_SERVER_RDMA_SERVER_H_
#define TF_RDMA_CC_TF_SERVER_RDMA_SERVER_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/protobuf/cluster.pb.h"

namespace tf_rdma {

inline constexpr char kProtocol[] = "grpc+tf_rdma";

// Task name -> "host:port", for tasks whose tf_rdma listener is not at their TensorFlow port +
// TF_RDMA_PORT_OFFSET (tf_rdma.Server's rdma_addresses).
using AddressOverrides = std::map<std::string, std::string>;
// The overrides every server created afterwards in this process applies.
void SetAddressOverrides(AddressOverrides overrides);

// Every task of `cluster` with its tf_rdma endpoint: its TensorFlow port + TF_RDMA_PORT_OFFSET,
// unless overridden; a task on port 0 (any free port) listens on any free port too.
absl::StatusOr<std::vector<TaskAddress>> TasksOf(const tensorflow::ClusterDef& cluster, const Config& config,
                                                 const AddressOverrides& overrides);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_SERVER_RDMA_SERVER_H_
