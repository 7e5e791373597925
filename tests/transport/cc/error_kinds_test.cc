// Error kinds (cc/transport/error_kinds.h): marked where a failure arises, kept when the status is
// worded again on its way up, absent where nobody marked one (the code decides then).
#include "cc/transport/error_kinds.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace tf_rdma {
namespace {

TEST(ErrorKinds, AMarkedKindIsReadBackByItsName) {
  const absl::Status status =
      WithErrorKind(absl::FailedPreconditionError("no RDMA device reaches ps:0"), ErrorKind::kRdmaDeviceMismatch);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrorKindOf(status), "rdma_device_mismatch");
  EXPECT_EQ(ErrorKindOf(absl::FailedPreconditionError("unmarked")), std::nullopt);
}

TEST(ErrorKinds, EveryKindHasItsOwnName) {
  EXPECT_EQ(ErrorKindName(ErrorKind::kHandshake), "handshake");
  EXPECT_EQ(ErrorKindName(ErrorKind::kMissingLibrary), "missing_library");
  EXPECT_EQ(ErrorKindName(ErrorKind::kRdmaDeviceMismatch), "rdma_device_mismatch");
}

TEST(ErrorKinds, WordingAStatusAgainKeepsItsCodeAndKind) {
  absl::Status cause = WithErrorKind(absl::FailedPreconditionError("libcrypto.so.3 not found"),
                                     ErrorKind::kMissingLibrary);
  cause.SetPayload("other/payload", absl::Cord("kept"));
  const absl::Status worded = WithContext(cause, "the tcp backend is not available: libcrypto.so.3 not found");
  EXPECT_EQ(worded.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(worded.message(), "the tcp backend is not available: libcrypto.so.3 not found");
  EXPECT_EQ(ErrorKindOf(worded), "missing_library");
  ASSERT_TRUE(worded.GetPayload("other/payload").has_value());
  EXPECT_EQ(std::string(*worded.GetPayload("other/payload")), "kept");
}

TEST(ErrorKinds, AnOkStatusTakesNoKind) {
  EXPECT_TRUE(WithErrorKind(absl::OkStatus(), ErrorKind::kHandshake).ok());
  EXPECT_EQ(ErrorKindOf(absl::OkStatus()), std::nullopt);
}

}  // namespace
}  // namespace tf_rdma
