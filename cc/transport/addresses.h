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

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_ADDRESSES_H_
