// How a peer's REJECT reads to users and to the code that blames tasks: a peer that closed because
// this process went silent (kDeadlineExceeded) is this process's failure, worded from the code, not
// from the peer's text; its other reasons are the peer's.
#include "cc/transport/peer_errors.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace tf_rdma {
namespace {

uint32_t Code(absl::StatusCode code) { return static_cast<uint32_t>(code); }

TEST(PeerClosedConnection, ThePeerHearingNothingFromUsIsOurSilence) {
  const absl::Status reason = WentSilentReason(absl::Milliseconds(2002));
  const absl::Status closed = PeerClosedConnection("/job:ps/replica:0/task:0", "10.0.0.2:2223",
                                                   Code(reason.code()), std::string(reason.message()));
  EXPECT_TRUE(absl::IsUnavailable(closed)) << closed;
  EXPECT_TRUE(PeerFoundThisProcessSilent(closed)) << closed;
  EXPECT_NE(closed.message().find("peer /job:ps/replica:0/task:0 at 10.0.0.2:2223 closed the connection"),
            std::string::npos) << closed;
  EXPECT_NE(closed.message().find("2002 ms"), std::string::npos) << closed;
}

TEST(PeerClosedConnection, OtherReasonsAreThePeers) {
  for (const absl::StatusCode code : {absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled,
                                      absl::StatusCode::kDataLoss}) {
    // Even worded as our silence: the wording follows the code.
    const absl::Status closed =
        PeerClosedConnection("peer", "host:1", Code(code), "it heard nothing from this process for 1 ms");
    EXPECT_FALSE(PeerFoundThisProcessSilent(closed)) << closed;
  }
  EXPECT_FALSE(PeerFoundThisProcessSilent(
      PeerFailure("peer", "host:1", absl::DeadlineExceededError("the peer sent nothing for 2002 ms"))));
}

TEST(PeerClosedConnection, AHostilePeersTextIsBounded) {
  const absl::Status closed = PeerClosedConnection("peer", "host:1", Code(absl::StatusCode::kDeadlineExceeded),
                                                   std::string(1 << 20, 'x'));
  EXPECT_LT(closed.message().size(), 512u);
}

TEST(PeerFailure, ThePeersSilenceIsToldFromOtherFailures) {
  const absl::Status silent =
      PeerFailure("/job:worker/replica:0/task:0", "host:1", absl::DeadlineExceededError("the peer sent nothing for 2002 ms"));
  EXPECT_TRUE(PeerWentSilent(silent)) << silent;
  EXPECT_FALSE(PeerFoundThisProcessSilent(silent)) << silent;
  EXPECT_FALSE(PeerWentSilent(PeerFailure("peer", "host:1", absl::UnavailableError("connection reset")))) << silent;
  // The other side's view: it closed because this process went silent.
  const absl::Status reason = WentSilentReason(absl::Milliseconds(2002));
  EXPECT_FALSE(PeerWentSilent(PeerClosedConnection("peer", "host:1", Code(reason.code()),
                                                   std::string(reason.message()))));
}

TEST(PeerFailure, NoPeerTextOrNameReadsAsSilence) {
  const std::string hostile = " is unresponsive: closed the connection because it heard nothing from this process for";
  for (const absl::StatusCode code : {absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled}) {
    const absl::Status closed = PeerClosedConnection(hostile, "host:1", Code(code), hostile);
    EXPECT_FALSE(PeerWentSilent(closed)) << closed;
    EXPECT_FALSE(PeerFoundThisProcessSilent(closed)) << closed;
  }
  const absl::Status reset = PeerFailure(hostile, "host:1", absl::UnavailableError(hostile));
  EXPECT_FALSE(PeerWentSilent(reset)) << reset;
  EXPECT_FALSE(PeerFoundThisProcessSilent(reset)) << reset;
  // Copies keep what the status is.
  const absl::Status silent = PeerFailure("peer", "host:1", absl::DeadlineExceededError("1 ms"));
  const absl::Status copy = silent;
  EXPECT_TRUE(PeerWentSilent(copy)) << copy;
}

}  // namespace
}  // namespace tf_rdma
