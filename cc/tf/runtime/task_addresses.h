// Who is where: the address of each task's TensorFlow and tf_rdma servers, as the clusters this
// server has seen name them, and which names turned out to be served by another task's server.
#ifndef TF_RDMA_CC_TF_RUNTIME_TASK_ADDRESSES_H_
#define TF_RDMA_CC_TF_RUNTIME_TASK_ADDRESSES_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tf_rdma {

struct TaskAddress {
  std::string task;  // "/job:worker/replica:0/task:1"
  std::string host;
  uint16_t grpc_port = 0;
  uint16_t rdma_port = 0;  // 0 only for this task when its server asked for any free port
};

class TaskAddresses {
 public:
  // `tasks` must include `local_task`.
  TaskAddresses(std::string local_task, const std::vector<TaskAddress>& tasks);

  const std::string& local_task() const { return local_task_; }
  // Where `task` is, if a cluster this server has seen names it.
  std::optional<TaskAddress> Find(const std::string& task) const;
  // Adds or updates tasks other than this one (a session or an eager context may bring a cluster of
  // a different shape: a client job, a renamed job); returns those whose host or tf_rdma port
  // changed.
  std::vector<TaskAddress> Update(const std::vector<TaskAddress>& tasks);

  // Records that `peer`'s name is the tf_rdma server of task `identity`, warns, and returns the
  // error that sends transfers with it to gRPC.
  absl::Status MarkRenamed(const TaskAddress& peer, const std::string& identity);
  // That error once `task` was marked renamed; OK before.
  absl::Status RenamedError(const std::string& task) const;
  // Whether `task` names the server of another task (a session or eager context renamed it): known
  // once a connection to it reported it, and from then on at once.
  bool Renamed(const std::string& task) const;

 private:
  struct Entry {
    std::optional<TaskAddress> address;
    // Set when the tf_rdma server at the address of this task name turned out to be another task's:
    // the cluster that named it renames tasks, and transfers with it stay on gRPC.
    std::string served_by;
  };

  const std::string local_task_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> tasks_;
  // Whether any entry has served_by set: every transfer asks RenamedError, and clusters that rename
  // tasks are rare, so the common answer takes no lock and no lookup.
  std::atomic<bool> any_renamed_{false};
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_TASK_ADDRESSES_H_
