// BackendName, ParseBackend and BackendNames (transport.h), apart from transport.cc and the
// registry (backend_registry.h) so that pure code that names backends (the handshake's tokens)
// links without the backends themselves, as its units do.
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/transport.h"

namespace tf_rdma {
namespace {

// What each backend is called in TF_RDMA_BACKEND, in the handshake and in logs.
constexpr std::pair<Backend, const char*> kNames[] = {
    {Backend::kTcp, "tcp"},
    {Backend::kShm, "shm"},
    {Backend::kVerbs, "verbs"},
};

}  // namespace

const char* BackendName(Backend backend) {
  for (const auto& [named, name] : kNames) {
    if (named == backend) return name;
  }
  return "unknown";
}

std::string BackendNames() {
  return absl::StrJoin(kNames, ", ", [](std::string* out, const std::pair<Backend, const char*>& entry) {
    out->append(entry.second);
  });
}

absl::StatusOr<Backend> ParseBackend(const std::string& name) {
  for (const auto& [backend, known] : kNames) {
    if (name == known) return backend;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", name, "'; expected one of: ", BackendNames()));
}

}  // namespace tf_rdma
