// The errors every backend reports when a peer fails, worded once so users see the same message
// (naming the peer and the likely fix) whatever carries their tensors.
#ifndef TF_RDMA_CC_TRANSPORT_PEER_ERRORS_H_
#define TF_RDMA_CC_TRANSPORT_PEER_ERRORS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace tf_rdma {

// `cause` from the connection's own view: kDeadlineExceeded (the peer went silent), kDataLoss (it
// broke the protocol), kResourceExhausted (serving it ran into this process's limits: memory,
// mappings; kept as such, not reported as the peer's failure), anything else (the connection broke).
absl::Status PeerFailure(const std::string& peer_name, const std::string& peer_address,
                         const absl::Status& cause);

// The peer closed the connection and said why (`code`, `message` of its REJECT frame). Its
// protocol complaints about us are reported as kUnavailable: the broken party is not this process.
// kDeadlineExceeded from the peer means it heard nothing from this process for its peer timeout
// (WentSilentReason): reported as kUnavailable, worded as this process's failure.
absl::Status PeerClosedConnection(const std::string& peer_name, const std::string& peer_address,
                                  uint32_t code, const std::string& message);

// The peer withdrew the message a grant of ours waited for (a WITHDRAWN frame),
// with status `code` (not OK; wire.cc checks) and `reason`, its text escaped. kAborted, as the
// sender's step was: the receive's step is to be aborted and retried, not taken for a lost peer.
absl::Status PeerWithdrewMessage(const std::string& peer_name, const std::string& peer_address,
                                 uint32_t code, const std::string& reason);

// What a connection tells its peer when it closes because the peer went silent for `silence`.
absl::Status WentSilentReason(absl::Duration silence);

// Whether `status` is PeerClosedConnection's saying the peer closed the connection because this
// process went silent towards it: stopped (SIGSTOP, a debugger), starved of CPU or cut off. The
// failure is then this process's, not the peer's, which callers that blame tasks need to know.
// Told by the status itself (a payload, kept by copies), not its text: a peer's name or REJECT
// text cannot make another status read so. A status made anew from its message loses it.
bool PeerFoundThisProcessSilent(const absl::Status& status);

// Whether `status` is PeerFailure's saying this process closed the connection because the peer went
// silent for the peer timeout: it may be stopped or cut off for a while and then run again. Told
// as PeerFoundThisProcessSilent is.
bool PeerWentSilent(const absl::Status& status);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_PEER_ERRORS_H_
