// Task names: the task a device is on, and a failure worded after the task it happened with.
#ifndef TF_RDMA_CC_TF_RUNTIME_TASK_NAMES_H_
#define TF_RDMA_CC_TF_RUNTIME_TASK_NAMES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tf_rdma {

// "/job:worker/replica:0/task:1/device:CPU:0" -> "/job:worker/replica:0/task:1".
absl::StatusOr<std::string> TaskOfDevice(const std::string& device);

// Whether the two devices are on different tasks (both fully qualified).
bool CrossesTasks(const std::string& from_device, const std::string& to_device);

// A transfer with `task` failed: "tf_rdma: <what> task <task> failed: <cause>". When the task is
// unavailable (it died, hung or cannot be reached), the message also carries the phrase with which
// gRPC reports a failed remote task, since TensorFlow's own libraries recognise a failed task by it
// (ClusterCoordinator tells a parameter server's failure from a worker's that way). Not when the
// task closed the connection because this process went silent: then the failure is this task's.
absl::Status TaskFailure(const std::string& what, const std::string& task, const absl::Status& cause);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_TASK_NAMES_H_
