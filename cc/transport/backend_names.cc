// BackendName and ParseBackend (transport.h), apart from transport.cc so that pure code that names
// backends (the handshake's tokens) links without the backends themselves, as its units do.
#include "absl/strings/str_cat.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kTcp: return "tcp";
    case Backend::kShm: return "shm";
    case Backend::kVerbs: return "verbs";
  }
  return "unknown";
}

absl::StatusOr<Backend> ParseBackend(const std::string& name) {
  for (Backend backend : {Backend::kTcp, Backend::kShm, Backend::kVerbs}) {
    if (name == BackendName(backend)) return backend;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", name, "'; expected one of: verbs, tcp, shm"));
}

}  // namespace tf_rdma
