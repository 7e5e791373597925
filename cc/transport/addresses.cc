#include "cc/transport/addresses.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

bool IsLoopback(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(address);
    return (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
  }
  if (address->sa_family == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  }
  return false;
}

bool SameAddress(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

}  // namespace

absl::StatusOr<AddressList> ResolveEndpoint(const Endpoint& endpoint, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* resolved = nullptr;
  const std::string port = std::to_string(endpoint.port);
  const int rc = getaddrinfo(endpoint.host.empty() ? nullptr : endpoint.host.c_str(), port.c_str(),
                             &hints, &resolved);
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve '", endpoint.ToString(), "': ", gai_strerror(rc)));
  }
  return AddressList(resolved, &freeaddrinfo);
}

absl::StatusOr<bool> IsLocalHost(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &resolved);
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve host '", host, "': ", gai_strerror(rc)));
  }
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) interfaces = nullptr;
  bool local = false;
  for (addrinfo* a = resolved; a != nullptr && !local; a = a->ai_next) {
    local = IsLoopback(a->ai_addr);
    for (ifaddrs* i = interfaces; i != nullptr && !local; i = i->ifa_next) {
      local = i->ifa_addr != nullptr && SameAddress(a->ai_addr, i->ifa_addr);
    }
  }
  if (interfaces != nullptr) freeifaddrs(interfaces);
  freeaddrinfo(resolved);
  return local;
}

std::string IpAddressOf(const sockaddr* address) {
  char host[INET6_ADDRSTRLEN] = "";
  if (address != nullptr && address->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(address)->sin_addr, host, sizeof(host));
  } else if (address != nullptr && address->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr, host, sizeof(host));
  }
  return host;
}

}  // namespace tf_rdma
