#include "cc/transport/backend_selection.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/addresses.h"
#include "cc/transport/backend_registry.h"
#include "cc/transport/error_kinds.h"

namespace tf_rdma {
namespace {

absl::StatusOr<BackendChoice> ChooseExplicitly(const std::string& requested, const std::string& peer_host,
                                               bool local, const TransportOptions& options) {
  absl::StatusOr<Backend> backend = ParseBackend(requested);
  if (!backend.ok()) return backend.status();
  // The availability's own code: a bad override is a configuration error, a missing device or
  // library an unavailable backend.
  absl::Status available = BackendAvailable(*backend, options);
  if (!available.ok()) {
    return WithContext(available, absl::StrCat(
        "TF_RDMA_BACKEND=", requested, " but that backend is not available: ", available.message(),
        ". Unset TF_RDMA_BACKEND (auto) to use what works on this host."));
  }
  if (RegistrationOf(*backend).this_host_only && !local) {
    // A configuration error, as the transport's own refusal to connect there is (ConfigError in
    // Python, InvalidArgumentError from TensorFlow).
    return absl::InvalidArgumentError(absl::StrCat(
        "TF_RDMA_BACKEND=", requested, " but peer ", peer_host, " is on another host; ", requested,
        " reaches only peers on this host. Use TF_RDMA_BACKEND=auto."));
  }
  return BackendChoice{*backend, "TF_RDMA_BACKEND says so"};
}

}  // namespace

absl::StatusOr<BackendChoice> ChooseBackend(const std::string& requested, const std::string& peer_host,
                                            const TransportOptions& options) {
  absl::StatusOr<bool> local = IsLocalHost(peer_host);
  if (!local.ok()) return local.status();
  if (requested != "auto") return ChooseExplicitly(requested, peer_host, *local, options);
  std::vector<const BackendRegistration*> by_rank;
  for (const BackendRegistration& registration : RegisteredBackends()) by_rank.push_back(&registration);
  std::sort(by_rank.begin(), by_rank.end(), [](const BackendRegistration* a, const BackendRegistration* b) {
    return a->auto_rank < b->auto_rank;
  });
  // Why each backend auto prefers was passed over, the reason of a last resort.
  std::vector<std::string> passed_over;
  for (const BackendRegistration* registration : by_rank) {
    if (registration->this_host_only && !*local) continue;
    absl::Status usable = registration->viable(options);
    // A peer address no RDMA device reaches (on a plain Ethernet interface) is for tcp: verbs would
    // only fail to connect.
    if (usable.ok() && registration->reaches != nullptr) usable = registration->reaches(peer_host);
    if (usable.ok()) {
      return BackendChoice{registration->backend, registration->chosen_because != nullptr
                                                      ? registration->chosen_because
                                                      : absl::StrJoin(passed_over, "; ")};
    }
    passed_over.push_back(absl::StrCat(BackendName(registration->backend), " unusable: ", usable.message()));
  }
  return absl::UnavailableError(absl::StrCat("no backend reaches ", peer_host, ": ",
                                             absl::StrJoin(passed_over, "; ")));
}

}  // namespace tf_rdma
