#include "cc/transport/peer_errors.h"

#include "absl/strings/str_cat.h"

namespace tf_rdma {

absl::Status PeerFailure(const std::string& peer_name, const std::string& peer_address,
                         const absl::Status& cause) {
  const std::string who = absl::StrCat("peer ", peer_name, " at ", peer_address);
  switch (cause.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return absl::UnavailableError(absl::StrCat(
          who, " is unresponsive: ", cause.message(),
          " (TF_RDMA_PEER_TIMEOUT_MS). It died, hangs, or the network is down."));
    case absl::StatusCode::kDataLoss:
      return absl::DataLossError(
          absl::StrCat(who, " broke the tf_rdma protocol: ", cause.message(), "; connection closed."));
    case absl::StatusCode::kResourceExhausted:
      // Our limit, not the peer's disappearance: said as such, so that it is not taken for a
      // network failure.
      return absl::ResourceExhaustedError(absl::StrCat(
          "the connection to ", who, " ran into a resource limit: ", cause.message(),
          "; connection closed."));
    default:
      return absl::UnavailableError(absl::StrCat("lost connection to ", who, ": ", cause.message()));
  }
}

absl::Status PeerClosedConnection(const std::string& peer_name, const std::string& peer_address,
                                  uint32_t code, const std::string& message) {
  auto status_code = code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code)
                                            : absl::StatusCode::kUnavailable;
  if (status_code == absl::StatusCode::kDataLoss) status_code = absl::StatusCode::kUnavailable;
  return absl::Status(status_code, absl::StrCat("peer ", peer_name, " at ", peer_address,
                                                " closed the connection: ", message));
}

}  // namespace tf_rdma
