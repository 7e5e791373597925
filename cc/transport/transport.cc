#include "cc/transport/transport.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/crypto.h"
#include "cc/transport/shm/shm_transport.h"
#include "cc/transport/tcp/tcp_transport.h"
#ifdef TF_RDMA_HAVE_VERBS
#include "cc/transport/verbs/rdma_libraries.h"
#include "cc/transport/verbs/verbs_transport.h"
#endif

namespace tf_rdma {

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<Endpoint> Endpoint::Parse(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 == text.size()) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint '", text, "' is not host:port"));
  }
  std::string host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  uint32_t port = 0;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint '", text, "' has no valid port (0-65535)"));
  }
  return Endpoint{host, static_cast<uint16_t>(port)};
}

absl::Status BackendAvailable(Backend backend) {
  switch (backend) {
    case Backend::kTcp:
      return absl::OkStatus();
    case Backend::kShm: {
      const int fd = memfd_create("tf_rdma-probe", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (fd < 0) {
        return absl::UnavailableError(absl::StrCat("memfd_create fails: ", std::strerror(errno)));
      }
      close(fd);
      return absl::OkStatus();
    }
    case Backend::kVerbs:
#ifdef TF_RDMA_HAVE_VERBS
    {
      // First, since every verbs call goes through the libraries this loads (rdma_libraries.h).
      absl::Status libraries = verbs::LoadRdmaLibraries();
      if (!libraries.ok()) return libraries;
      return VerbsBackendAvailable();
    }
#else
      return absl::UnimplementedError(
          "this tf_rdma build has no verbs backend: rdma-core's development headers "
          "(infiniband/verbs.h, rdma/rdma_cma.h) were missing when it was built. Install them "
          "(`apt-get install libibverbs-dev librdmacm-dev` on Debian/Ubuntu, `dnf install "
          "rdma-core-devel` on RHEL/Fedora), then rebuild tf_rdma (`pip install --force-reinstall "
          "--no-deps /path/to/tf_rdma`)");
#endif
  }
  return absl::InvalidArgumentError("unknown backend");
}

absl::Status RdmaReaches(const std::string& host) {
#ifdef TF_RDMA_HAVE_VERBS
  // Its route check calls into rdma-core, which must be loaded first (rdma_libraries.h).
  absl::Status libraries = verbs::LoadRdmaLibraries();
  if (!libraries.ok()) return libraries;
  return VerbsReaches(host);
#else
  return BackendAvailable(Backend::kVerbs);
#endif
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(Backend backend,
                                                           const TransportOptions& options) {
  if (options.peer_timeout <= absl::ZeroDuration() || options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("peer_timeout and connect_timeout must be positive");
  }
  absl::Status crypto = LoadCrypto();
  if (!crypto.ok()) return crypto;
  absl::Status available = BackendAvailable(backend);
  if (!available.ok()) {
    return absl::Status(available.code(), absl::StrCat("the ", BackendName(backend),
                                                       " backend is not available: ",
                                                       available.message()));
  }
  switch (backend) {
    case Backend::kTcp: return CreateTcpTransport(options);
    case Backend::kShm: return CreateShmTransport(options);
    case Backend::kVerbs:
#ifdef TF_RDMA_HAVE_VERBS
      return CreateVerbsTransport(options);
#else
      break;
#endif
  }
  return absl::UnimplementedError(absl::StrCat("no ", BackendName(backend), " backend"));
}

}  // namespace tf_rdma
