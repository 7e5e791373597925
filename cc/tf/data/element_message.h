// How a tf.data service element travels over tf_rdma: the trainer writes a request (its client,
// the element's sequence number, TensorFlow's GetElementRequest) into ranges the worker keeps
// granted; the worker answers with each large component written straight from the tensor's memory
// under its own tag, and a header message (status, flags, every component's TensorHeader, small
// components inline) that the trainer reads first.
#ifndef TF_RDMA_CC_TF_DATA_ELEMENT_MESSAGE_H_
#define TF_RDMA_CC_TF_DATA_ELEMENT_MESSAGE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/tf/data/data_transfer_api.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/transport/transport.h"
#include "google/protobuf/message.h"

namespace tf_rdma {

// What a worker grants for one request, and so the most a request may hold.
constexpr uint64_t kMaxRequestBytes = 64 << 10;
// Components of one element (each a tag and a header); more is refused by both sides.
constexpr uint32_t kMaxComponents = 4096;
// The most a response header message may take (headers, small components, the status message).
constexpr uint64_t kMaxResponseHeaderBytes = 64ull << 20;
// What a trainer grants for a header message before it knows the element.
constexpr uint64_t kResponseHeaderGrant = 64 << 10;

// Every request of a connection shares one tag: the worker's grants pair with writes in order.
Tag RequestTag();
// slot 0: the header message; slot i + 1: component i's bytes. No digest per call: it runs for
// every message of every element.
constexpr int kResponseSlotBits = 13;
Tag ResponseTag(uint64_t client_id, uint64_t sequence, uint32_t slot);

struct ElementRequest {
  uint64_t client_id = 0;
  uint64_t sequence = 0;
  std::string_view serialized_request;  // a tensorflow.data.GetElementRequest; DecodeRequest's
                                        // points into the bytes it decoded
};
std::string EncodeRequest(const ElementRequest& request);
absl::StatusOr<ElementRequest> DecodeRequest(const char* bytes, uint64_t length);

// GetElementRequest is a generated protobuf class whose header is not shipped; its only base is
// google::protobuf::Message, so it is handled as one.
const google::protobuf::Message& AsMessage(const tensorflow::data::GetElementRequest& request);
// An empty GetElementRequest of TensorFlow's own generated class, or why not.
absl::StatusOr<std::unique_ptr<google::protobuf::Message>> NewGetElementRequest();
const tensorflow::data::GetElementRequest* AsGetElementRequest(const google::protobuf::Message& message);

// A response as the worker sends it. `separate` components are written from `data`, which points
// into the result's tensors or into `protos` (string and variant tensors, as TensorProto).
struct EncodedResponse {
  std::string header_message;
  struct Separate {
    uint32_t component;
    const char* data;
    uint64_t length;
  };
  std::vector<Separate> separate;
  std::vector<std::unique_ptr<std::string>> protos;
};
EncodedResponse EncodeResponse(const absl::Status& status, const tensorflow::data::GetElementResult& result);

// A response as the trainer reads it; inline bytes point into the header message.
struct DecodedResponse {
  absl::Status status;
  bool end_of_sequence = false;
  bool skip = false;
  int64_t element_index = 0;
  struct Component {
    TensorHeader header;
    std::string_view inline_bytes;  // when it travelled inline
    bool separate = false;
  };
  std::vector<Component> components;
};
absl::StatusOr<DecodedResponse> DecodeResponse(const char* bytes, uint64_t length);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_DATA_ELEMENT_MESSAGE_H_
