#include "cc/transport/backend_registry.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "cc/transport/crypto.h"
#include "cc/transport/error_kinds.h"
#include "cc/transport/shm/shm_transport.h"
#include "cc/transport/tcp/tcp_transport.h"
#ifdef TF_RDMA_HAVE_VERBS
#include "cc/transport/verbs/verbs_transport.h"
#endif

namespace tf_rdma {
namespace {

#ifndef TF_RDMA_HAVE_VERBS
absl::Status VerbsNotBuilt(const TransportOptions&) {
  return absl::UnimplementedError(
      "this tf_rdma build has no verbs backend: rdma-core's development headers "
      "(infiniband/verbs.h, rdma/rdma_cma.h) were missing when it was built. Install them "
      "(`apt-get install libibverbs-dev librdmacm-dev` on Debian/Ubuntu, `dnf install "
      "rdma-core-devel` on RHEL/Fedora), then rebuild tf_rdma (`pip install --force-reinstall "
      "--no-deps /path/to/tf_rdma`)");
}
#endif

// Indexed by Backend's enumerators, in their order (checked below).
constexpr BackendRegistration kBackends[] = {
    {Backend::kTcp,
     [](const TransportOptions&) { return absl::OkStatus(); },
     /*this_host_only=*/false,
     /*reaches=*/nullptr,
     [](const TransportOptions& options) -> absl::StatusOr<std::unique_ptr<Transport>> {
       return CreateTcpTransport(options);
     },
     /*auto_rank=*/2, /*chosen_because=*/nullptr, /*stream_wire=*/true},
    {Backend::kShm,
     [](const TransportOptions&) { return ShmAvailable(); },
     /*this_host_only=*/true,
     /*reaches=*/nullptr,
     [](const TransportOptions& options) -> absl::StatusOr<std::unique_ptr<Transport>> {
       return CreateShmTransport(options);
     },
     /*auto_rank=*/0, "peer is on this host", /*stream_wire=*/true},
#ifdef TF_RDMA_HAVE_VERBS
    {Backend::kVerbs, VerbsAvailable, /*this_host_only=*/false, VerbsReaches, CreateVerbsTransport,
     /*auto_rank=*/1, "an RDMA device reaches the peer", /*stream_wire=*/false},
#else
    // Never viable, so never created or asked whether it reaches a peer.
    {Backend::kVerbs, VerbsNotBuilt, /*this_host_only=*/false, /*reaches=*/nullptr, /*create=*/nullptr,
     /*auto_rank=*/1, /*chosen_because=*/nullptr, /*stream_wire=*/false},
#endif
};

constexpr bool IndexedByEnumerator() {
  for (size_t i = 0; i < std::size(kBackends); ++i) {
    if (static_cast<size_t>(kBackends[i].backend) != i) return false;
  }
  return true;
}
static_assert(IndexedByEnumerator(), "kBackends must list the backends in Backend's order");

}  // namespace

absl::Span<const BackendRegistration> RegisteredBackends() { return kBackends; }

const BackendRegistration& RegistrationOf(Backend backend) {
  return kBackends[static_cast<size_t>(backend)];
}

absl::Status BackendAvailable(Backend backend, const TransportOptions& options) {
  return RegistrationOf(backend).viable(options);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(Backend backend,
                                                           const TransportOptions& options) {
  if (options.peer_timeout <= absl::ZeroDuration() || options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("peer_timeout and connect_timeout must be positive");
  }
  absl::Status crypto = LoadCrypto();
  if (!crypto.ok()) return crypto;
  absl::Status available = BackendAvailable(backend, options);
  if (!available.ok()) {
    return WithContext(available, absl::StrCat("the ", BackendName(backend), " backend is not available: ",
                                               available.message()));
  }
  return RegistrationOf(backend).create(options);
}

}  // namespace tf_rdma
