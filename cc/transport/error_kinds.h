// What kind of failure a status is, marked where the failure arises. A status code says what the
// caller may do (retry, give up) and is shared by unrelated failures: a FAILED_PRECONDITION may be
// a peer of another cluster, a missing libcrypto or an RDMA device that does not reach the peer.
// The kind, carried as a payload that survives the status being worded again on its way up
// (WithContext), tells them apart; the Python binding raises the exception of the kind
// (tf_rdma/errors.py), and of the code only where no kind was marked.
#ifndef TF_RDMA_CC_TRANSPORT_ERROR_KINDS_H_
#define TF_RDMA_CC_TRANSPORT_ERROR_KINDS_H_

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/cord.h"

namespace tf_rdma {

enum class ErrorKind {
  // The peer is not a compatible member of this cluster: another cluster key, wire protocol or
  // backend, a reflected handshake, or the listener refused this process for good.
  kHandshake,
  // A shared library tf_rdma needs cannot be loaded, or is broken (libcrypto for the handshake).
  kMissingLibrary,
  // The RDMA device, port or GID the settings name cannot reach the peer, or none can.
  kRdmaDeviceMismatch,
};

// A function, not an inline variable: that would be a symbol each extension using it defines
// again beside the transport library's, where the core's data lives only (tests/test_setup.py).
constexpr std::string_view ErrorKindPayloadUrl() { return "tf_rdma/error_kind"; }

// The kind's name as the binding passes it to Python (tf_rdma/errors.py: _BY_KIND).
inline constexpr std::string_view ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kHandshake: return "handshake";
    case ErrorKind::kMissingLibrary: return "missing_library";
    case ErrorKind::kRdmaDeviceMismatch: return "rdma_device_mismatch";
  }
  return "";
}

inline absl::Status WithErrorKind(absl::Status status, ErrorKind kind) {
  if (!status.ok()) status.SetPayload(ErrorKindPayloadUrl(), absl::Cord(ErrorKindName(kind)));
  return status;
}

// The kind's name, or nullopt where none was marked.
inline std::optional<std::string> ErrorKindOf(const absl::Status& status) {
  std::optional<absl::Cord> kind = status.GetPayload(ErrorKindPayloadUrl());
  if (!kind.has_value()) return std::nullopt;
  return std::string(*kind);
}

// `cause` worded as `message`, with its code and every payload (its kind among them) kept.
inline absl::Status WithContext(const absl::Status& cause, std::string_view message) {
  absl::Status worded(cause.code(), message);
  cause.ForEachPayload([&worded](std::string_view url, const absl::Cord& payload) {
    worded.SetPayload(url, payload);
  });
  return worded;
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_ERROR_KINDS_H_
