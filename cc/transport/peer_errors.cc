#include "cc/transport/peer_errors.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

// Only PeerClosedConnection's kDeadlineExceeded wording has it: its other wordings put the peer's
// own text after "closed the connection: ".
constexpr char kHeardNothingFromThisProcess[] = "closed the connection because it heard nothing from this process for";
// Only PeerFailure's kDeadlineExceeded wording has it.
constexpr char kIsUnresponsive[] = " is unresponsive: ";

}  // namespace

absl::Status PeerFailure(const std::string& peer_name, const std::string& peer_address,
                         const absl::Status& cause) {
  const std::string who = absl::StrCat("peer ", peer_name, " at ", peer_address);
  switch (cause.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return absl::UnavailableError(absl::StrCat(
          who, kIsUnresponsive, cause.message(),
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
  const std::string who = absl::StrCat("peer ", peer_name, " at ", peer_address);
  if (status_code == absl::StatusCode::kDeadlineExceeded) {
    // The peer's words are only its figure: the wording, and so PeerFoundThisProcessSilent's
    // answer, follow from the code.
    return absl::UnavailableError(absl::StrCat(
        who, " ", kHeardNothingFromThisProcess, " ", message.substr(0, 64),
        " (its TF_RDMA_PEER_TIMEOUT_MS). This process was stopped (SIGSTOP, a debugger), starved of CPU, "
        "or cut off from it."));
  }
  return absl::Status(status_code, absl::StrCat(who, " closed the connection: ", message));
}

absl::Status WentSilentReason(absl::Duration silence) {
  return absl::DeadlineExceededError(absl::StrCat(absl::ToInt64Milliseconds(silence), " ms"));
}

bool PeerFoundThisProcessSilent(const absl::Status& status) {
  return absl::IsUnavailable(status) && absl::StrContains(status.message(), kHeardNothingFromThisProcess);
}

bool PeerWentSilent(const absl::Status& status) {
  return absl::IsUnavailable(status) && absl::StrContains(status.message(), kIsUnresponsive);
}

}  // namespace tf_rdma
