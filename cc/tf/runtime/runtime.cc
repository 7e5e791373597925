#include "cc/tf/runtime/runtime.h"

#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/transport/crypto.h"

namespace tf_rdma {
namespace {

std::mutex registry_mu;
// Never destroyed: transfers may complete on transport threads until the process exits.
auto* registry = new std::vector<std::shared_ptr<Runtime>>();

}  // namespace

Runtime::Runtime(RuntimeOptions options)
    : options_(std::move(options)),
      task_addresses_(options_.local_task, options_.tasks),
      transports_(options_.local_task, options_.config),
      receive_pools_(transports_, options_.min_slab_bytes, options_.max_slab_bytes, options_.config.receive_pool_idle),
      connections_(options_.config, options_.serve_any_peer, task_addresses_, transports_, receive_pools_, stats_) {}

absl::StatusOr<std::shared_ptr<Runtime>> Runtime::Start(const RuntimeOptions& options) {
  // Tensor tags are SHA-256 digests (cc/tf/messages/tensor_message.cc); the handshake needs
  // libcrypto too.
  absl::Status crypto = LoadCrypto();
  if (!crypto.ok()) return crypto;
  std::shared_ptr<Runtime> runtime(new Runtime(options));
  const std::optional<TaskAddress> self = runtime->task_addresses_.Find(options.local_task);
  if (!self) {
    return absl::InvalidArgumentError(absl::StrCat("task ", options.local_task, " is not in its own cluster"));
  }
  absl::StatusOr<uint16_t> port = runtime->connections_.Listen(*self);
  if (!port.ok()) return port.status();
  runtime->port_ = *port;
  runtime->receive_pools_.StartReleasingIdleRegions();
  std::lock_guard<std::mutex> lock(registry_mu);
  registry->push_back(runtime);
  return runtime;
}

std::vector<std::shared_ptr<Runtime>> Runtime::Running() {
  std::lock_guard<std::mutex> lock(registry_mu);
  return *registry;
}

void Runtime::UpdateTasks(const std::vector<TaskAddress>& tasks) {
  for (const TaskAddress& moved : task_addresses_.Update(tasks)) {
    connections_.Retire(moved.task,
                        absl::UnavailableError(absl::StrCat("task ", moved.task, " moved to ", moved.host)));
  }
}

}  // namespace tf_rdma
