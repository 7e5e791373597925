// Device, port and GID discovery for the verbs backend, and the errors RDMA users actually hit
// (no device, no active port, a device/port that does not exist, a link-local GID, `ulimit -l` too
// low), each worded to name the fix.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_VERBS_DEVICE_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_VERBS_DEVICE_H_

#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/transport/transport.h"

namespace tf_rdma::verbs {

// OK when some device (the one the settings name, if any) has an active port; otherwise why not,
// listing what ibv_get_device_list returned.
absl::Status CheckVerbsUsable(const VerbsSettings& settings);

// Checks that `context` (an open device) fits the overrides: the port exists and is active, the GID
// index exists on it and is not link-local. `port` is the port to check (the override or resolved).
absl::Status CheckPortAndGid(ibv_context* context, int port, int gid_index);

// Every RDMA device with its ports' states and the IP addresses rdma_cm reaches each port by:
// "rxe0 (port 1 ACTIVE, 10.77.0.1 on dummy0)". Walks the GID tables: for errors only.
std::string DescribeDevices();

// rdma_cm reaches an IP address only through an RDMA device: the interface this host sends from
// toward `destination` must be a RoCE port's netdev (or an IPoIB interface). FailedPrecondition
// naming `peer`, that interface, the devices with their addresses and the fix if it is not;
// OK otherwise. Goes by the routing table, so a peer that is merely not up yet passes.
absl::Status CheckRdmaRoute(const sockaddr* destination, socklen_t length, const std::string& peer);

// FailedPrecondition of kind kRdmaDeviceMismatch: no RDMA device, or not the one the settings
// name (device, port, GID), reaches the address in question; `message` names it and the fix.
absl::Status DeviceMismatchError(std::string message);

std::string DeviceName(ibv_context* context);
std::string GidToString(const ibv_gid& gid);
bool IsLinkLocal(const ibv_gid& gid);

// rdma-core asks for ibv_fork_init before the first registration (data loaders fork). Idempotent.
void EnsureForkSafety();

// Bytes of memory this process has pinned through the verbs backend (page-rounded).
size_t PinnedBytes();
void AddPinnedBytes(ptrdiff_t delta);

// The error for a failed or refused registration of `bytes` bytes of `what`; errno `error`. When
// the locked-memory limit explains it, says the number needed and how to raise the limit.
absl::Status RegistrationError(const std::string& what, size_t bytes, int error,
                               const std::string& device);
// Fails before pinning `bytes` more when RLIMIT_MEMLOCK (and no CAP_IPC_LOCK) cannot allow it.
absl::Status CheckMemlockAllows(const std::string& what, size_t bytes, const std::string& device);

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_VERBS_DEVICE_H_
