#include "cc/tf/data/element_message.h"

#include <cstring>
#include <typeinfo>

#include "absl/strings/str_cat.h"
#include "cc/transport/crypto.h"
#include "google/protobuf/descriptor.h"
#include "tensorflow/core/framework/tensor.pb.h"

namespace tf_rdma {
namespace {

constexpr uint32_t kRequestMagic = 0x51444654;   // "TFDQ"
constexpr uint32_t kResponseMagic = 0x52444654;  // "TFDR"
constexpr uint64_t kRequestFixedBytes = 4 + 8 + 8 + 4;
constexpr uint64_t kResponseFixedBytes = 4 + 4 + 4 + 4 + 8 + 4;
// A worker's error reaches the trainer with at most this much of its message.
constexpr uint64_t kMaxStatusMessageBytes = 4096;
constexpr uint32_t kEndOfSequence = 1;
constexpr uint32_t kSkip = 2;

// Reads what a peer sent, never past its end.
class Reader {
 public:
  Reader(const char* bytes, uint64_t length) : in_(reinterpret_cast<const uint8_t*>(bytes)), left_(length) {}
  bool Get(int bytes, uint64_t* value) {
    if (left_ < static_cast<uint64_t>(bytes)) return false;
    *value = 0;
    for (int i = 0; i < bytes; ++i) *value |= static_cast<uint64_t>(in_[i]) << (8 * i);
    in_ += bytes;
    left_ -= bytes;
    return true;
  }
  bool View(uint64_t length, std::string_view* view) {
    if (left_ < length) return false;
    *view = std::string_view(reinterpret_cast<const char*>(in_), length);
    in_ += length;
    left_ -= length;
    return true;
  }
  uint64_t left() const { return left_; }

 private:
  const uint8_t* in_;
  uint64_t left_;
};

absl::Status Malformed(const std::string& what, const std::string& why) {
  return absl::DataLossError(absl::StrCat("malformed tf.data ", what, " from the peer: ", why));
}

Tag TagOf(const std::string& name) {
  const Sha256Digest digest = Sha256(name);
  return Tag{LoadLittleEndian64(digest.data()), LoadLittleEndian64(digest.data() + 8)};
}

}  // namespace

// Digests once per process: every element's messages take their tags from these by arithmetic.
Tag RequestTag() {
  static const Tag tag = TagOf("tf.data request");
  return tag;
}

Tag ResponseTag(uint64_t client_id, uint64_t sequence, uint32_t slot) {
  // Unique per (client, sequence, slot) for a client's first 2^51 elements; the request tag is
  // a digest, which these meet only by a 2^-64 chance.
  static_assert(kMaxComponents < (1u << kResponseSlotBits), "a slot must fit its bits");
  static const Tag base = TagOf("tf.data element");
  return Tag{base.hi ^ client_id, base.lo ^ ((sequence << kResponseSlotBits) | slot)};
}

std::string EncodeRequest(const ElementRequest& request) {
  std::string out;
  out.reserve(kRequestFixedBytes + request.serialized_request.size());
  AppendLittleEndian(out, kRequestMagic, 4);
  AppendLittleEndian(out, request.client_id, 8);
  AppendLittleEndian(out, request.sequence, 8);
  AppendLittleEndian(out, request.serialized_request.size(), 4);
  out.append(request.serialized_request);
  return out;
}

absl::StatusOr<ElementRequest> DecodeRequest(const char* bytes, uint64_t length) {
  Reader in(bytes, length);
  uint64_t magic = 0, proto_bytes = 0;
  ElementRequest request;
  std::string_view proto;
  if (!in.Get(4, &magic) || magic != kRequestMagic || !in.Get(8, &request.client_id) ||
      !in.Get(8, &request.sequence) || !in.Get(4, &proto_bytes) || !in.View(proto_bytes, &proto) ||
      in.left() != 0) {
    return Malformed("request", absl::StrCat(length, " bytes that are not a request"));
  }
  request.serialized_request = proto;
  return request;
}

const google::protobuf::Message& AsMessage(const tensorflow::data::GetElementRequest& request) {
  return *reinterpret_cast<const google::protobuf::Message*>(&request);
}

absl::StatusOr<std::unique_ptr<google::protobuf::Message>> NewGetElementRequest() {
  // Looked up once: every request a worker answers makes one.
  static const google::protobuf::Message* const prototype = [] {
    const google::protobuf::Descriptor* descriptor =
        google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName("tensorflow.data.GetElementRequest");
    const google::protobuf::Message* found =
        descriptor == nullptr ? nullptr : google::protobuf::MessageFactory::generated_factory()->GetPrototype(descriptor);
    // The generated class itself, so that TensorFlow may use the object as one.
    return found != nullptr && std::string(typeid(*found).name()) == "N10tensorflow4data17GetElementRequestE" ? found
                                                                                                            : nullptr;
  }();
  if (prototype == nullptr) {
    return absl::FailedPreconditionError(
        "this TensorFlow has no generated tensorflow.data.GetElementRequest; tf_rdma's tf.data "
        "protocol was built for TensorFlow 2.21's data service");
  }
  return std::unique_ptr<google::protobuf::Message>(prototype->New());
}

const tensorflow::data::GetElementRequest* AsGetElementRequest(const google::protobuf::Message& message) {
  return reinterpret_cast<const tensorflow::data::GetElementRequest*>(&message);
}

EncodedResponse EncodeResponse(const absl::Status& status, const tensorflow::data::GetElementResult& result) {
  EncodedResponse out;
  const std::string message(status.message().substr(0, kMaxStatusMessageBytes));
  const bool components = status.ok() && !result.end_of_sequence && !result.skip;
  const uint32_t count = components ? static_cast<uint32_t>(result.components.size()) : 0;
  std::string& head = out.header_message;
  head.reserve(kResponseFixedBytes + message.size());
  AppendLittleEndian(head, kResponseMagic, 4);
  AppendLittleEndian(head, static_cast<uint32_t>(status.code()), 4);
  AppendLittleEndian(head, (result.end_of_sequence ? kEndOfSequence : 0) | (result.skip ? kSkip : 0), 4);
  AppendLittleEndian(head, count, 4);
  AppendLittleEndian(head, static_cast<uint64_t>(result.element_index), 8);
  AppendLittleEndian(head, message.size(), 4);
  head += message;
  for (uint32_t i = 0; i < count; ++i) {
    const tensorflow::Tensor& tensor = result.components[i];
    TensorHeader header;
    header.dtype = tensor.dtype();
    header.shape = tensor.shape();
    const char* data = nullptr;
    if (TravelsAsBytes(tensor.dtype())) {
      const std::string_view bytes = tensor.tensor_data();
      data = bytes.data();
      header.data_bytes = bytes.size();
    } else {
      tensorflow::TensorProto proto;
      tensor.AsProtoTensorContent(&proto);
      out.protos.push_back(std::make_unique<std::string>(proto.SerializeAsString()));
      data = out.protos.back()->data();
      header.data_bytes = out.protos.back()->size();
    }
    const bool inline_bytes = TravelsInline(header);
    const std::string encoded = EncodeHeader(header);
    AppendLittleEndian(head, encoded.size() + (inline_bytes ? header.data_bytes : 0), 8);
    head += encoded;
    if (inline_bytes) {
      head.append(data, header.data_bytes);
    } else {
      out.separate.push_back({i, data, header.data_bytes});
    }
  }
  return out;
}

absl::StatusOr<DecodedResponse> DecodeResponse(const char* bytes, uint64_t length) {
  Reader in(bytes, length);
  uint64_t magic = 0, code = 0, flags = 0, count = 0, index = 0, message_bytes = 0;
  std::string_view message;
  if (!in.Get(4, &magic) || magic != kResponseMagic || !in.Get(4, &code) || !in.Get(4, &flags) ||
      !in.Get(4, &count) || !in.Get(8, &index) || !in.Get(4, &message_bytes) ||
      message_bytes > kMaxStatusMessageBytes || !in.View(message_bytes, &message)) {
    return Malformed("response", absl::StrCat(length, " bytes that are not a response"));
  }
  if (code > static_cast<uint64_t>(absl::StatusCode::kUnauthenticated) || count > kMaxComponents ||
      (code != 0 && count != 0)) {
    return Malformed("response", absl::StrCat("status ", code, " with ", count, " components"));
  }
  DecodedResponse response;
  response.status = absl::Status(static_cast<absl::StatusCode>(code), message);
  if (code != 0 && response.status.ok()) response.status = absl::UnknownError("the worker failed");
  response.end_of_sequence = flags & kEndOfSequence;
  response.skip = flags & kSkip;
  response.element_index = static_cast<int64_t>(index);
  response.components.resize(count);
  for (auto& component : response.components) {
    uint64_t encoded_bytes = 0;
    std::string_view encoded;
    if (!in.Get(8, &encoded_bytes) || !in.View(encoded_bytes, &encoded)) {
      return Malformed("response", "a component past the message's end");
    }
    uint64_t data_offset = 0;
    absl::StatusOr<TensorHeader> header = DecodeHeader(encoded.data(), encoded.size(), &data_offset);
    if (!header.ok()) return header.status();
    if (header->dead) return Malformed("response", "a dead component");
    component.header = *header;
    component.separate = !TravelsInline(*header);
    if (!component.separate) component.inline_bytes = encoded.substr(data_offset);
  }
  if (in.left() != 0) return Malformed("response", absl::StrCat(in.left(), " bytes after the last component"));
  return response;
}

}  // namespace tf_rdma
