#include "cc/transport/backend_selection.h"

#include "absl/strings/str_cat.h"
#include "cc/transport/addresses.h"

namespace tf_rdma {

absl::StatusOr<BackendChoice> ChooseBackend(const std::string& requested, const std::string& peer_host) {
  absl::StatusOr<bool> local = IsLocalHost(peer_host);
  if (!local.ok()) return local.status();
  if (requested != "auto") {
    absl::StatusOr<Backend> backend = ParseBackend(requested);
    if (!backend.ok()) return backend.status();
    absl::Status available = BackendAvailable(*backend);
    if (!available.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "TF_RDMA_BACKEND=", requested, " but that backend is not available: ", available.message(),
          ". Unset TF_RDMA_BACKEND (auto) to use what works on this host."));
    }
    if (*backend == Backend::kShm && !*local) {
      return absl::FailedPreconditionError(absl::StrCat(
          "TF_RDMA_BACKEND=shm but peer ", peer_host, " is on another host; shm reaches only "
          "peers on this host. Use TF_RDMA_BACKEND=auto."));
    }
    return BackendChoice{*backend, "TF_RDMA_BACKEND says so"};
  }
  absl::Status shm = BackendAvailable(Backend::kShm);
  if (*local && shm.ok()) return BackendChoice{Backend::kShm, "peer is on this host"};
  absl::Status verbs = BackendAvailable(Backend::kVerbs);
  // A peer address no RDMA device reaches (on a plain Ethernet interface) is for tcp: verbs would
  // only fail to connect.
  if (verbs.ok()) verbs = RdmaReaches(peer_host);
  if (verbs.ok()) return BackendChoice{Backend::kVerbs, "an RDMA device reaches the peer"};
  std::string why = absl::StrCat("verbs unusable: ", verbs.message());
  if (*local) absl::StrAppend(&why, "; shm unusable: ", shm.message());
  return BackendChoice{Backend::kTcp, why};
}

}  // namespace tf_rdma
