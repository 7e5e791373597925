#ifndef TF_RDMA_CC_TRANSPORT_ADDRESSES_H_
#define TF_RDMA_CC_TRANSPORT_ADDRESSES_H_

#include <netdb.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

using AddressList = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// The stream-socket addresses of `endpoint` (an empty host with `passive`: every local address).
// Fails with kInvalidArgument, naming the endpoint, when it does not resolve.
absl::StatusOr<AddressList> ResolveEndpoint(const Endpoint& endpoint, bool passive);

// Whether `host` (name or address) resolves to this machine: a loopback address or one bound to a
// local interface. Fails when the name does not resolve.
absl::StatusOr<bool> IsLocalHost(const std::string& host);

// The IP address of an IPv4 or IPv6 socket address, without its port (what the listeners' limits
// per source count by); empty for any other family.
std::string IpAddressOf(const sockaddr* address);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_ADDRESSES_H_
