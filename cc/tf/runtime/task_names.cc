#include "cc/tf/runtime/task_names.h"

#include "absl/strings/str_cat.h"
#include "cc/transport/peer_errors.h"

namespace tf_rdma {

absl::StatusOr<std::string> TaskOfDevice(const std::string& device) {
  const size_t at = device.find("/device:");
  if (device.rfind("/job:", 0) != 0 || at == std::string::npos || device.find("/task:") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", device, "' is not a fully qualified device name"));
  }
  return device.substr(0, at);
}

bool CrossesTasks(const std::string& from_device, const std::string& to_device) {
  absl::StatusOr<std::string> from = TaskOfDevice(from_device);
  absl::StatusOr<std::string> to = TaskOfDevice(to_device);
  return from.ok() && to.ok() && *from != *to;
}

absl::Status TaskFailure(const std::string& what, const std::string& task, const absl::Status& cause) {
  std::string message = absl::StrCat("tf_rdma: ", what, " task ", task, " failed: ", cause.message());
  // Not when the task closed the connection because this one went silent (stopped, cut off): the
  // failure is this task's, and a ClusterCoordinator reading the phrase would count a healthy ps
  // as failed (TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES) where it should retry on this worker.
  if ((absl::IsUnavailable(cause) || absl::IsAborted(cause)) && !PeerFoundThisProcessSilent(cause)) {
    absl::StrAppend(&message, " (as gRPC words it, for TensorFlow's failure handling: GRPC error information from remote target ", task, ")");
  }
  return absl::Status(cause.code(), message);
}

}  // namespace tf_rdma
