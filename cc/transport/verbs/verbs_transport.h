// The verbs backend: reliable-connected queue pairs set up through librdmacm (which picks the
// device, port and RoCE v2 GID from the peer's IP address), overridable with TF_RDMA_VERBS_DEVICE,
// TF_RDMA_VERBS_PORT and TF_RDMA_VERBS_GID_INDEX (TransportOptions::verbs). Compiled only when
// rdma-core's headers exist (TF_RDMA_HAVE_VERBS).
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_VERBS_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_VERBS_TRANSPORT_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cc/transport/config.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

// Why verbs cannot work here (rdma-core missing, no device, no active port, a device or port
// options.verbs names that does not exist), or OK.
absl::Status VerbsAvailable(const TransportOptions& options);
// Whether some RDMA device reaches `host` (the interface this host sends to it from is an RDMA
// device's, see verbs::CheckRdmaRoute), and if not, why, naming the devices and their addresses.
absl::Status VerbsReaches(const std::string& host);
absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const TransportOptions& options);

// The device, port and source GID index the verbs backend's connections from `host` (an address of
// this host's RDMA netdev) use under `config`'s TF_RDMA_VERBS_* settings: rdma_cm's choice for the
// address, or the overrides; `gid_chosen_by` says which. For tools that must use the same ones
// (the bench's perftest).
struct VerbsLocalPort {
  std::string device;
  int port = 0;
  int gid_index = -1;
  std::string gid_chosen_by;
};
absl::StatusOr<VerbsLocalPort> ResolveVerbsLocalPort(const std::string& host, const Config& config);
// Registration cache counters (hits, misses, evictions, invalidations, uncached), pinned bytes, and
// grants carried by grant-table writes (written, read); process-wide.
std::map<std::string, uint64_t> VerbsStatistics();

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_VERBS_TRANSPORT_H_
