// Every backend, registered once (backend_registry.cc): whether it can work in this process, which
// peers it reaches, and how to create it (after TensorPipe's Context::isViable and
// canCommunicateWithRemote). Transport creation, backend selection, the TensorFlow runtime's
// listeners, the configuration and the Python bindings (and through them the tests) ask the
// registry rather than name backends, so a new backend is its folder, its enumerator and name
// (transport.h, backend_names.cc) and one registration.
#ifndef TF_RDMA_CC_TRANSPORT_BACKEND_REGISTRY_H_
#define TF_RDMA_CC_TRANSPORT_BACKEND_REGISTRY_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

struct BackendRegistration {
  Backend backend;
  // Why it cannot work in this process with these options, or OK: Unimplemented where this host
  // lacks what it needs (a device, a library, a kernel feature), so Python raises
  // BackendUnavailableError; InvalidArgument (ConfigError) where a setting names what does not
  // exist (a device, a port).
  absl::Status (*viable)(const TransportOptions& options);
  // Reaches only peers on this host (it shares memory with them): another host's peer is never
  // its to serve, so auto passes over it without a reason, and asking for it explicitly is an error.
  bool this_host_only;
  // Once viable: whether it reaches a peer at `host` (verbs: an RDMA device routes to it), or
  // why not. Null: every peer it may serve.
  absl::Status (*reaches)(const std::string& host);
  // Called only once viable() said OK.
  absl::StatusOr<std::unique_ptr<Transport>> (*create)(const TransportOptions& options);
  // Its place in auto's order: the first viable backend that reaches the peer serves it.
  int auto_rank;
  // Why auto took it, for the log line naming each peer's backend (e.g. "peer is on this host").
  // Null for a last resort (tcp): auto then says why each backend before it was passed over.
  const char* chosen_because;
  // It carries the stream wire format (cc/transport/stream/) over a socket, which raw-socket tests
  // speak; such backends run on every Linux host.
  bool stream_wire;
};

// Every backend, in Backend's order, which is also the order a runtime's listeners bind: tcp
// first, since with port 0 the free TCP port it gets becomes every backend's (shm's abstract socket
// names and rdma_cm's ports follow it).
absl::Span<const BackendRegistration> RegisteredBackends();
const BackendRegistration& RegistrationOf(Backend backend);

// Whether `backend` can work in this process with `options`, and if not, why (e.g. "no RDMA device
// found").
absl::Status BackendAvailable(Backend backend, const TransportOptions& options);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_BACKEND_REGISTRY_H_
