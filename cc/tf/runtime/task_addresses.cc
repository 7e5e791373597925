#include "cc/tf/runtime/task_addresses.h"

#include <utility>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

// The server at `peer`'s address is tf_rdma's server of another task: the cluster the caller got the
// address from names the tasks differently from how their servers were started.
absl::Status RenamedPeer(const TaskAddress& peer, const std::string& identity) {
  return absl::FailedPreconditionError(absl::StrCat(
      "task ", peer.task, " at ", peer.host, ":", peer.grpc_port, " is served by the tf_rdma server of task ",
      identity, ": a session or eager context renamed it (ClusterSpec propagation), so tensors with it go "
      "over gRPC, counted in tf_rdma.stats()['fallback']. To carry them over tf_rdma, start each server "
      "under the job name and index the session's cluster gives it"));
}

}  // namespace

TaskAddresses::TaskAddresses(std::string local_task, const std::vector<TaskAddress>& tasks)
    : local_task_(std::move(local_task)) {
  for (const TaskAddress& task : tasks) tasks_[task.task].address = task;
}

std::optional<TaskAddress> TaskAddresses::Find(const std::string& task) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tasks_.find(task);
  if (it == tasks_.end()) return std::nullopt;
  return it->second.address;
}

std::vector<TaskAddress> TaskAddresses::Update(const std::vector<TaskAddress>& tasks) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TaskAddress> moved;
  for (const TaskAddress& task : tasks) {
    if (task.task == local_task_) continue;
    std::optional<TaskAddress>& known = tasks_[task.task].address;
    if (known && (known->host != task.host || known->rdma_port != task.rdma_port)) moved.push_back(task);
    known = task;
  }
  return moved;
}

absl::Status TaskAddresses::MarkRenamed(const TaskAddress& peer, const std::string& identity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_[peer.task].served_by = identity;
    any_renamed_.store(true, std::memory_order_release);
  }
  absl::Status renamed = RenamedPeer(peer, identity);
  LOG(WARNING) << "tf_rdma: " << renamed.message();
  return renamed;
}

absl::Status TaskAddresses::RenamedError(const std::string& task) const {
  if (!any_renamed_.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tasks_.find(task);
  if (it == tasks_.end() || it->second.served_by.empty()) return absl::OkStatus();
  return RenamedPeer(it->second.address.value_or(TaskAddress{task}), it->second.served_by);
}

bool TaskAddresses::Renamed(const std::string& task) const {
  if (!any_renamed_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tasks_.find(task);
  return it != tasks_.end() && !it->second.served_by.empty();
}

}  // namespace tf_rdma
