// TF_RDMA_* environment variables, parsed and validated by the table of settings.h. Every variable
// is also in the README's table; a TF_RDMA_* name this build does not know is an error, so a typo
// cannot silently leave a setting at its default.
#ifndef TF_RDMA_CC_TRANSPORT_CONFIG_H_
#define TF_RDMA_CC_TRANSPORT_CONFIG_H_

#include <map>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/transport/settings.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

// The settings of cc/transport/settings.h, parsed; unset ones have the table's defaults.
struct Config {
  std::string backend = settings::kBackend.default_label;  // or a backend's name (backend_registry.h)
  absl::Duration peer_timeout = settings::kPeerTimeoutMs.default_duration();
  absl::Duration connect_timeout = settings::kConnectTimeoutMs.default_duration();
  // TF_RDMA_SECRET, or the contents of TF_RDMA_SECRET_FILE; empty: no secret.
  std::string secret;
  // A task's tf_rdma port is its TensorFlow server port plus this.
  int port_offset = settings::kPortOffset.default_value;
  // TF_RDMA_VERBS_DEVICE, TF_RDMA_VERBS_PORT, TF_RDMA_VERBS_GID_INDEX, TF_RDMA_VERBS_POLL_US.
  VerbsSettings verbs;
  // The I/O threads each transport serves all its connections from.
  size_t io_threads = settings::kIoThreads.default_value;
  // How long a tcp or shm I/O thread polls before it sleeps.
  absl::Duration stream_poll_window = settings::kStreamPollUs.default_duration();
  // tf.data service: elements a trainer's client keeps receive grants posted for, beyond the one it
  // reads, so the worker's writes find their ranges waiting.
  int data_prefetch_elements = settings::kDataPrefetchElements.default_value;
  // A receive pool's region none of whose buffers was lent for this long goes back to the
  // transport; zero keeps regions for good.
  absl::Duration receive_pool_idle = settings::kReceivePoolIdleMs.default_duration();
  // Bounds on the worker-service calls peers make here (cc/tf/calls/).
  uint64_t max_call_bytes = settings::kMaxCallBytes.default_value;
  size_t max_calls_per_peer = settings::kMaxCallsPerPeer.default_value;
  // TF_RDMA_MAX_CONCURRENT_HANDSHAKES, TF_RDMA_MAX_GRANTS_PER_PEER,
  // TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER, TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL,
  // TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME.
  TransportLimits limits;
};

// Parses `environment` (name -> value, typically the process environment's TF_RDMA_* entries).
absl::StatusOr<Config> ParseConfig(const std::map<std::string, std::string>& environment);
absl::StatusOr<Config> LoadConfigFromEnvironment();

// The options a transport of this configuration is created with, but for what only its creator
// knows: local_name and cluster_key.
TransportOptions TransportOptionsFrom(const Config& config);

// The rule a secret must meet (TF_RDMA_SECRET, TF_RDMA_SECRET_FILE; docs/security.md). A task's
// handshake proof reaches whoever answers at the address it dials, who can test guesses of the
// secret offline, so a secret must be random: at least kMinSecretBytes written as hex or base64
// (base64url), with no stretch of about 40 bits (kPatternStretchHex or kPatternStretchBase64
// characters) repeated or a run, not letters of one case only, and not a UUID. Repetition, alphabets and
// words fail it; random text of 16 bytes or more fails it with odds stated in docs/security.md.
constexpr size_t kMinSecretBytes = 16;
constexpr size_t kPatternStretchHex = 10;
constexpr size_t kPatternStretchBase64 = 7;
// What makes `secret` fail the rule ("holds a run of ..."), or "" if it passes.
std::string SecretFlaw(std::string_view secret);

// The key peers prove to each other in the handshake: HKDF-SHA-256 of the secret (config.secret).
absl::StatusOr<std::string> ClusterKey(std::string_view secret);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_CONFIG_H_
