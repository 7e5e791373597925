#include "cc/tf/runtime/transports.h"

#include <algorithm>

namespace tf_rdma {

Transports::Transports(const std::string& local_task, const Config& config)
    : local_task_(local_task), config_(config) {}

absl::StatusOr<Transport*> Transports::For(Backend backend) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transports_.find(backend);
  if (it != transports_.end()) return it->second.get();
  TransportOptions transport_options = TransportOptionsFrom(config_);
  transport_options.local_name = local_task_;
  absl::StatusOr<std::string> cluster_key = ClusterKey(config_.secret);
  if (!cluster_key.ok()) return cluster_key.status();
  transport_options.cluster_key = *std::move(cluster_key);
  transport_options.connect_timeout = std::min(kConnectAttempt, config_.connect_timeout);
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateTransport(backend, transport_options);
  if (!transport.ok()) return transport.status();
  Transport* raw = transport->get();
  transports_[backend] = std::move(*transport);
  return raw;
}

absl::StatusOr<std::pair<Transport*, BackendChoice>> Transports::To(const std::string& host) {
  absl::StatusOr<BackendChoice> choice = ChooseBackend(config_.backend, host, TransportOptionsFrom(config_));
  if (!choice.ok()) return choice.status();
  absl::StatusOr<Transport*> transport = For(choice->backend);
  if (!transport.ok()) return transport.status();
  return std::make_pair(*transport, *choice);
}

}  // namespace tf_rdma
