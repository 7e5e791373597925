#include "cc/transport/config.h"

#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace tf_rdma {
namespace {

constexpr char kPrefix[] = "TF_RDMA_";

absl::StatusOr<absl::Duration> ParseMilliseconds(const std::string& name, const std::string& value,
                                                 int64_t minimum) {
  int64_t ms = 0;
  if (!absl::SimpleAtoi(value, &ms) || ms < minimum || ms > 86400000) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, "='", value, "' is not a whole number of milliseconds between ", minimum,
        " and 86400000; set it to e.g. 30000 or unset it"));
  }
  return absl::Milliseconds(ms);
}

}  // namespace

const std::vector<ConfigVariable>& ConfigVariables() {
  static const auto* variables = new std::vector<ConfigVariable>{
      {"TF_RDMA_BACKEND", "auto",
       "Transport for tensors between tasks: auto (shm for peers on this host, verbs where an RDMA "
       "device works, else tcp), verbs, tcp or shm. An explicit backend that cannot work is an error."},
      {"TF_RDMA_PEER_TIMEOUT_MS", "30000",
       "A peer silent this long (no data, no heartbeat) is declared dead and its pending transfers fail."},
      {"TF_RDMA_CONNECT_TIMEOUT_MS", "60000",
       "How long connecting to a peer is retried (peers may start in any order) before failing."},
      {"TF_RDMA_SECRET", "(empty)",
       "Shared secret mixed into the cluster key: peers without it cannot connect or write."},
      {"TF_RDMA_SOFTROCE_CACHE", "build/softroce",
       "Test harness only: where the Soft-RoCE guest's kernel and initramfs are cached."},
  };
  return *variables;
}

absl::StatusOr<Config> ParseConfig(const std::map<std::string, std::string>& environment) {
  Config config;
  for (const auto& [name, value] : environment) {
    if (name.rfind(kPrefix, 0) != 0) continue;
    if (name == "TF_RDMA_BACKEND") {
      if (value != "auto" && value != "verbs" && value != "tcp" && value != "shm") {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_BACKEND='", value, "' is not a backend; use one of auto, verbs, tcp, shm"));
      }
      config.backend = value;
    } else if (name == "TF_RDMA_PEER_TIMEOUT_MS") {
      absl::StatusOr<absl::Duration> d = ParseMilliseconds(name, value, 100);
      if (!d.ok()) return d.status();
      config.peer_timeout = *d;
    } else if (name == "TF_RDMA_CONNECT_TIMEOUT_MS") {
      absl::StatusOr<absl::Duration> d = ParseMilliseconds(name, value, 1);
      if (!d.ok()) return d.status();
      config.connect_timeout = *d;
    } else if (name == "TF_RDMA_SECRET") {
      config.secret = value;
    } else if (name != "TF_RDMA_SOFTROCE_CACHE") {
      std::vector<std::string> known;
      for (const auto& variable : ConfigVariables()) known.push_back(variable.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown environment variable ", name, "; tf_rdma reads only ",
          absl::StrJoin(known, ", "), ". Fix the name or unset it."));
    }
  }
  return config;
}

absl::StatusOr<Config> LoadConfigFromEnvironment() {
  std::map<std::string, std::string> environment;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const size_t equals = text.find('=');
    if (equals == std::string::npos || text.rfind(kPrefix, 0) != 0) continue;
    environment[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return ParseConfig(environment);
}

}  // namespace tf_rdma
