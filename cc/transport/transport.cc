#include "cc/transport/transport.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

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

}  // namespace tf_rdma
