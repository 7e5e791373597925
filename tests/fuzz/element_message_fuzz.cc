// tf.data service messages (cc/tf/data/element_message.h) as a peer may send them: the request a
// worker decodes (and parses as TensorFlow's GetElementRequest), and the response header message a
// trainer decodes, its inline components made into tensors as the trainer makes them. A response
// whose components all came inline must encode again, from those tensors, to one that decodes to
// the same status, flags and component dtypes and shapes.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "cc/tf/data/element_message.h"
#include "tests/fuzz/tensor_from_peer.h"

namespace {

constexpr char kTarget[] = "element_message_fuzz";

void CheckRequest(const char* bytes, size_t size) {
  absl::StatusOr<tf_rdma::ElementRequest> request = tf_rdma::DecodeRequest(bytes, size);
  if (!request.ok()) return;
  if (tf_rdma::EncodeRequest(*request) != std::string(bytes, size)) {
    tf_rdma::fuzz::Fail(kTarget, "a decoded request does not encode to the bytes it came from");
  }
  absl::StatusOr<std::unique_ptr<google::protobuf::Message>> parsed = tf_rdma::NewGetElementRequest();
  if (!parsed.ok()) tf_rdma::fuzz::Fail(kTarget, "no GetElementRequest in this TensorFlow");
  (*parsed)->ParseFromArray(request->serialized_request.data(), static_cast<int>(request->serialized_request.size()));
}

void CheckResponse(const char* bytes, size_t size) {
  absl::StatusOr<tf_rdma::DecodedResponse> response = tf_rdma::DecodeResponse(bytes, size);
  if (!response.ok()) return;
  tensorflow::data::GetElementResult result;
  result.end_of_sequence = response->end_of_sequence;
  result.skip = response->skip;
  result.element_index = response->element_index;
  bool all_inline = true;
  for (const tf_rdma::DecodedResponse::Component& component : response->components) {
    if (component.separate) {
      all_inline = false;
      continue;
    }
    const char* begin = component.inline_bytes.data();
    if (!component.inline_bytes.empty() && (begin < bytes || begin + component.inline_bytes.size() > bytes + size)) {
      tf_rdma::fuzz::Fail(kTarget, "inline bytes point outside the message");
    }
    absl::StatusOr<tensorflow::Tensor> tensor = tf_rdma::fuzz::TensorFromPeer(kTarget, component.header, component.inline_bytes);
    if (!tensor.ok()) return;
    result.components.push_back(*std::move(tensor));
  }
  if (!all_inline) return;
  const tf_rdma::EncodedResponse encoded = tf_rdma::EncodeResponse(response->status, result);
  absl::StatusOr<tf_rdma::DecodedResponse> again =
      tf_rdma::DecodeResponse(encoded.header_message.data(), encoded.header_message.size());
  if (!again.ok()) tf_rdma::fuzz::Fail(kTarget, "a response made from a decoded one does not decode");
  const bool components = response->status.ok() && !response->end_of_sequence && !response->skip;
  if (again->status.code() != response->status.code() || again->end_of_sequence != response->end_of_sequence ||
      again->skip != response->skip || again->element_index != response->element_index ||
      again->components.size() != (components ? result.components.size() : 0)) {
    tf_rdma::fuzz::Fail(kTarget, "a response made from a decoded one decodes to another");
  }
  for (size_t i = 0; i < again->components.size(); ++i) {
    if (again->components[i].header.dtype != result.components[i].dtype() ||
        again->components[i].header.shape != result.components[i].shape()) {
      tf_rdma::fuzz::Fail(kTarget, "a component changed its dtype or shape on the way back");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* bytes = reinterpret_cast<const char*>(data);
  CheckRequest(bytes, size);
  CheckResponse(bytes, size);
  return 0;
}
