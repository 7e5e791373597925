// One task's transports, one per backend, made on first use with the task's name, key and settings.
#ifndef TF_RDMA_CC_TF_RUNTIME_TRANSPORTS_H_
#define TF_RDMA_CC_TF_RUNTIME_TRANSPORTS_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/transport/backend_selection.h"
#include "cc/transport/config.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

// One connection attempt lasts this long before the runtime checks why the peer is not there.
constexpr absl::Duration kConnectAttempt = absl::Seconds(4);
// How long a task waits for a peer it was connected to to dial back before asking its ports why not.
constexpr absl::Duration kReconnectAttempt = absl::Milliseconds(250);

class Transports {
 public:
  // Both must outlive it (the Runtime's options do).
  Transports(const std::string& local_task, const Config& config);

  absl::StatusOr<Transport*> For(Backend backend);
  // The transport of the backend chosen for a peer on `host`, and why that backend.
  absl::StatusOr<std::pair<Transport*, BackendChoice>> To(const std::string& host);

 private:
  const std::string& local_task_;
  const Config& config_;
  std::mutex mu_;
  std::map<Backend, std::unique_ptr<Transport>> transports_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_TRANSPORTS_H_
