// A control call's messages (cc/tf/messages/call_message.h) as a peer may send them: its first
// byte picks the request slot's decoder (0), the reply's (1) or a CleanupGraphs request's (2). What
// decodes must encode back to the same bytes: a request as the caller wrote it, a reply with its
// status and payload, the step ids.
#include <cstdint>
#include <string>
#include <vector>

#include "cc/tf/messages/call_message.h"
#include "tests/fuzz/tensor_from_peer.h"

namespace {

constexpr char kTarget[] = "call_message_fuzz";

void Request(const char* bytes, size_t size) {
  std::string_view inline_payload;
  absl::StatusOr<tf_rdma::CallRequestHeader> header =
      tf_rdma::DecodeCallRequest(bytes, size, &inline_payload);
  if (!header.ok()) return;
  const bool travels_inline = tf_rdma::CallPayloadTravelsInline(header->payload_bytes);
  if (inline_payload.size() != (travels_inline ? header->payload_bytes : 0)) {
    tf_rdma::fuzz::Fail(kTarget, "a decoded request's inline payload is not the size its header says");
  }
  if (tf_rdma::EncodeCallRequest(*header, inline_payload) != std::string_view(bytes, size)) {
    tf_rdma::fuzz::Fail(kTarget, "a decoded request does not encode back to its message");
  }
}

void Reply(const char* bytes, size_t size) {
  absl::StatusOr<tf_rdma::CallReply> reply = tf_rdma::DecodeCallReply(bytes, size);
  if (!reply.ok()) return;
  const std::string again = tf_rdma::EncodeCallReply(reply->status, reply->payload);
  absl::StatusOr<tf_rdma::CallReply> twice = tf_rdma::DecodeCallReply(again.data(), again.size());
  if (!twice.ok() || twice->status != reply->status || twice->payload != reply->payload) {
    tf_rdma::fuzz::Fail(kTarget, "a decoded reply does not decode the same once encoded again");
  }
}

void CleanupSteps(const char* bytes, size_t size) {
  absl::StatusOr<std::vector<int64_t>> step_ids = tf_rdma::DecodeCleanupSteps(std::string_view(bytes, size));
  if (!step_ids.ok()) return;
  if (step_ids->empty() || step_ids->size() > tf_rdma::kMaxCleanupSteps ||
      tf_rdma::EncodeCleanupSteps(*step_ids) != std::string_view(bytes, size)) {
    tf_rdma::fuzz::Fail(kTarget, "decoded step ids are out of bounds or do not encode back to their request");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char* bytes = reinterpret_cast<const char*>(data) + 1;
  switch (data[0] % 3) {
    case 0: Request(bytes, size - 1); break;
    case 1: Reply(bytes, size - 1); break;
    default: CleanupSteps(bytes, size - 1);
  }
  return 0;
}
