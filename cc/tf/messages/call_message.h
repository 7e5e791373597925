// How a control call (a worker-service or eager-service request and its reply) travels between two
// tasks on their tf_rdma connection, as receiver-granted writes like everything else there:
//   * the serving side keeps a few request slots granted under CallRequestTag(); each request, and
//     each cancellation, is one message into the next slot, in the order the caller sent them;
//   * a request whose payload does not fit a slot sends only its header there, and its payload
//     under CallBodyTag(call id), into memory the serving side grants once it read the header;
//   * the caller grants the reply under CallReplyTag(call id) before it sends the request.
// Every field is checked on decoding: the bytes come from another process.
#ifndef TF_RDMA_CC_TF_MESSAGES_CALL_MESSAGE_H_
#define TF_RDMA_CC_TF_MESSAGES_CALL_MESSAGE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

// What a request slot holds: a header, and the payload when the whole fits.
constexpr uint64_t kCallRequestSlotBytes = 8 << 10;
constexpr uint64_t kCallRequestHeaderBytes = 24;

Tag CallRequestTag();
Tag CallBodyTag(uint64_t call_id);
Tag CallReplyTag(uint64_t call_id);

enum class CallFrame : uint8_t {
  kRequest = 1,  // a call: its method, id and payload
  kCancel = 2,   // the caller gave up the call with this id (cancelled, past its deadline)
};

struct CallRequestHeader {
  CallFrame frame = CallFrame::kRequest;
  uint8_t method = 0;
  uint64_t call_id = 0;
  uint64_t payload_bytes = 0;  // 0 for kCancel
};

// Whether a payload of `bytes` travels in the request slot with its header.
bool CallPayloadTravelsInline(uint64_t bytes);

// The slot's message: the header, then the payload if it travels inline (else pass it empty and
// send it under CallBodyTag).
std::string EncodeCallRequest(const CallRequestHeader& header, std::string_view inline_payload);
// A slot's message from the peer: its header, and in `inline_payload` the payload if it came along
// (empty when it comes under CallBodyTag). The size a header announces for a payload under
// CallBodyTag is the serving side's to judge (CallLimits).
absl::StatusOr<CallRequestHeader> DecodeCallRequest(const char* message, uint64_t length,
                                                    std::string_view* inline_payload);

// A reply: the call's status (code, message and payloads, as the serving task's worker returned
// them) and the reply's payload.
std::string EncodeCallReply(const absl::Status& status, std::string_view payload);
struct CallReply {
  absl::Status status;
  std::string_view payload;  // a view into the decoded message
};
absl::StatusOr<CallReply> DecodeCallReply(const char* message, uint64_t length);

// A CleanupGraphs call's request: the ids of the steps to clean up, 8 bytes each, little-endian;
// 1 to kMaxCleanupSteps of them.
constexpr size_t kMaxCleanupSteps = 256;
std::string EncodeCleanupSteps(absl::Span<const int64_t> step_ids);
absl::StatusOr<std::vector<int64_t>> DecodeCleanupSteps(std::string_view bytes);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_MESSAGES_CALL_MESSAGE_H_
