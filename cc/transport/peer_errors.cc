#include "cc/transport/peer_errors.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

constexpr char kHeardNothingFromThisProcess[] = "closed the connection because it heard nothing from this process for";
// Which of these statuses a status is, told by a payload rather than by its text: a peer chooses
// its name and its REJECT's text, which the messages quote, so text could be made to match.
constexpr char kPeerWentSilentPayload[] = "type.tf_rdma.dev/peer_went_silent";
constexpr char kThisProcessWentSilentPayload[] = "type.tf_rdma.dev/this_process_went_silent";

absl::Status Marked(absl::Status status, const char* payload) {
  status.SetPayload(payload, absl::Cord());
  return status;
}

}  // namespace

absl::Status PeerFailure(const std::string& peer_name, const std::string& peer_address,
                         const absl::Status& cause) {
  const std::string who = absl::StrCat("peer ", peer_name, " at ", peer_address);
  switch (cause.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return Marked(absl::UnavailableError(absl::StrCat(
                        who, " is unresponsive: ", cause.message(),
                        " (TF_RDMA_PEER_TIMEOUT_MS). It died, hangs, or the network is down.")),
                    kPeerWentSilentPayload);
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
    return Marked(absl::UnavailableError(absl::StrCat(
                      who, " ", kHeardNothingFromThisProcess, " ", message.substr(0, 64),
                      " (its TF_RDMA_PEER_TIMEOUT_MS). This process was stopped (SIGSTOP, a debugger), "
                      "starved of CPU, or cut off from it.")),
                  kThisProcessWentSilentPayload);
  }
  return absl::Status(status_code, absl::StrCat(who, " closed the connection: ", message));
}

absl::Status PeerWithdrewMessage(const std::string& peer_name, const std::string& peer_address,
                                 uint32_t code, const std::string& reason) {
  return absl::AbortedError(absl::StrCat("peer ", peer_name, " at ", peer_address,
                                         " withdrew the message this process waited for (",
                                         absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
                                         "): ", reason));
}

absl::Status WentSilentReason(absl::Duration silence) {
  return absl::DeadlineExceededError(absl::StrCat(absl::ToInt64Milliseconds(silence), " ms"));
}

bool PeerFoundThisProcessSilent(const absl::Status& status) {
  return status.GetPayload(kThisProcessWentSilentPayload).has_value();
}

bool PeerWentSilent(const absl::Status& status) { return status.GetPayload(kPeerWentSilentPayload).has_value(); }

}  // namespace tf_rdma
