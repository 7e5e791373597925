// tf.data element messages (cc/tf/data/element_message.h) as a trainer or worker decodes them from
// a hostile peer: every truncation, count and length is refused with an error, and no count a peer
// sends makes us allocate more than its message's bytes allow.
#include "cc/tf/data/element_message.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

#include "cc/transport/crypto.h"
#include "tensorflow/core/framework/tensor.pb.h"

namespace tf_rdma {
namespace {

using tensorflow::Tensor;
using tensorflow::TensorShape;

void Put(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// A response header message as a peer may write it: the fixed fields, then `components`.
std::string Response(uint32_t code, uint32_t count, const std::string& components, const std::string& message = "") {
  std::string out;
  Put(out, 0x52444654, 4);  // "TFDR"
  Put(out, code, 4);
  Put(out, 0, 4);
  Put(out, count, 4);
  Put(out, 7, 8);
  Put(out, message.size(), 4);
  return out + message + components;
}

// One component entry: its encoded TensorHeader and the inline bytes after it.
std::string Component(const TensorHeader& header, const std::string& inline_bytes = "") {
  const std::string encoded = EncodeHeader(header) + inline_bytes;
  std::string out;
  Put(out, encoded.size(), 8);
  return out + encoded;
}

absl::StatusOr<DecodedResponse> Decode(const std::string& bytes) { return DecodeResponse(bytes.data(), bytes.size()); }

tensorflow::data::GetElementResult Element() {
  tensorflow::data::GetElementResult result;
  Tensor floats(tensorflow::DT_FLOAT, TensorShape({64 << 10}));  // 256 KiB: travels on its own
  for (int64_t i = 0; i < floats.NumElements(); ++i) floats.flat<float>()(i) = static_cast<float>(i);
  Tensor labels(tensorflow::DT_INT64, TensorShape({3}));
  labels.flat<int64_t>().setValues({1, 7, -1});
  Tensor names(tensorflow::DT_STRING, TensorShape({2}));
  names.flat<tensorflow::tstring>().setValues({"element-1", ""});
  result.components = {floats, labels, names};
  result.element_index = 42;
  return result;
}

TEST(ElementMessage, AnElementRoundTripsEveryComponent) {
  const tensorflow::data::GetElementResult element = Element();
  const EncodedResponse encoded = EncodeResponse(absl::OkStatus(), element);
  ASSERT_EQ(encoded.separate.size(), 1u);
  EXPECT_EQ(encoded.separate[0].component, 0u);
  EXPECT_EQ(encoded.separate[0].length, element.components[0].TotalBytes());
  // The large component is written from the tensor's own memory, not a copy.
  EXPECT_EQ(encoded.separate[0].data, element.components[0].tensor_data().data());

  absl::StatusOr<DecodedResponse> decoded = Decode(encoded.header_message);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->status.ok());
  EXPECT_EQ(decoded->element_index, 42);
  ASSERT_EQ(decoded->components.size(), 3u);
  EXPECT_TRUE(decoded->components[0].separate);
  EXPECT_EQ(decoded->components[0].header.shape, TensorShape({64 << 10}));
  EXPECT_FALSE(decoded->components[1].separate);
  EXPECT_EQ(decoded->components[1].inline_bytes, element.components[1].tensor_data());
  absl::StatusOr<Tensor> names =
      TensorFromProtoBytes(decoded->components[2].header, decoded->components[2].inline_bytes);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_EQ(names->flat<tensorflow::tstring>()(0), "element-1");
  EXPECT_EQ(names->flat<tensorflow::tstring>()(1), "");
}

TEST(ElementMessage, AWorkersErrorArrivesAsItsStatus) {
  absl::StatusOr<DecodedResponse> decoded =
      Decode(EncodeResponse(absl::UnavailableError("worker going away"), {}).header_message);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(absl::IsUnavailable(decoded->status));
  EXPECT_EQ(decoded->status.message(), "worker going away");
  EXPECT_TRUE(decoded->components.empty());
}

TEST(ElementMessage, EveryTruncationOfAResponseIsRefused) {
  const std::string whole = EncodeResponse(absl::OkStatus(), Element()).header_message;
  ASSERT_TRUE(Decode(whole).ok());
  for (size_t length = 0; length < whole.size(); ++length) {
    absl::StatusOr<DecodedResponse> decoded = DecodeResponse(whole.data(), length);
    EXPECT_TRUE(absl::IsDataLoss(decoded.status())) << length << " bytes: " << decoded.status();
  }
  EXPECT_TRUE(absl::IsDataLoss(Decode(whole + "x").status()));
}

TEST(ElementMessage, CountsAndCodesPastTheirBoundsAreRefused) {
  // More components than any element may have, or than the message holds.
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(0, kMaxComponents + 1, "")).status()));
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(0, 0xffffffff, "")).status()));
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(0, 2, "")).status()));
  // Not a status code; an error with components; a status message past its bound.
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(99, 0, "")).status()));
  TensorHeader small{false, tensorflow::DT_INT32, TensorShape({1}), 4};
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(13, 1, Component(small, "abcd"))).status()));
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(13, 0, "", std::string(4097, 'x'))).status()));
  // A component entry whose length runs past the message.
  std::string past;
  Put(past, 1ull << 62, 8);
  EXPECT_TRUE(absl::IsDataLoss(Decode(Response(0, 1, past)).status()));
  // A shape that does not hold its bytes.
  TensorHeader lying{false, tensorflow::DT_INT32, TensorShape({2}), 4};
  EXPECT_FALSE(Decode(Response(0, 1, Component(lying, "abcd"))).ok());
  ASSERT_TRUE(Decode(Response(0, 1, Component(small, "abcd"))).ok());
}

TEST(ElementMessage, AStringCountIsBoundedByItsBytes) {
  // A few bytes may not announce 2^40 strings (or variants): at least a byte per element.
  for (tensorflow::DataType dtype : {tensorflow::DT_STRING, tensorflow::DT_VARIANT}) {
    TensorHeader huge{false, dtype, TensorShape({1ll << 20, 1ll << 20}), 16};
    absl::StatusOr<DecodedResponse> decoded = Decode(Response(0, 1, Component(huge, std::string(16, '\0'))));
    EXPECT_TRUE(absl::IsDataLoss(decoded.status())) << decoded.status();
    // Travelling on its own (past the inline size), the header alone would size the grant.
    TensorHeader separate{false, dtype, TensorShape({1ll << 40}), 1 << 20};
    decoded = Decode(Response(0, 1, Component(separate)));
    EXPECT_TRUE(absl::IsDataLoss(decoded.status())) << decoded.status();
  }
}

TEST(ElementMessage, ATensorProtoMustHaveItsHeadersShapeBeforeAnythingIsAllocated) {
  // A small, well-formed proto claiming 2^40 empty strings where its header said 2.
  tensorflow::TensorProto proto;
  proto.set_dtype(tensorflow::DT_STRING);
  proto.mutable_tensor_shape()->add_dim()->set_size(1ll << 40);
  const std::string bytes = proto.SerializeAsString();
  TensorHeader header{false, tensorflow::DT_STRING, TensorShape({2}), bytes.size()};
  absl::StatusOr<Tensor> tensor = TensorFromProtoBytes(header, bytes);
  EXPECT_TRUE(absl::IsDataLoss(tensor.status())) << tensor.status();
  // Another dtype than announced, bytes that are not a proto, fewer bytes than announced.
  Tensor names(tensorflow::DT_STRING, TensorShape({2}));
  tensorflow::TensorProto good;
  names.AsProtoTensorContent(&good);
  const std::string good_bytes = good.SerializeAsString();
  TensorHeader as_variant{false, tensorflow::DT_VARIANT, TensorShape({2}), good_bytes.size()};
  EXPECT_TRUE(absl::IsDataLoss(TensorFromProtoBytes(as_variant, good_bytes).status()));
  TensorHeader right{false, tensorflow::DT_STRING, TensorShape({2}), good_bytes.size()};
  EXPECT_TRUE(absl::IsDataLoss(TensorFromProtoBytes(right, std::string(good_bytes.size(), '\xff')).status()));
  EXPECT_TRUE(absl::IsDataLoss(TensorFromProtoBytes(right, good_bytes.substr(1)).status()));
  EXPECT_TRUE(TensorFromProtoBytes(right, good_bytes).ok());
}

TEST(ElementMessage, EveryTruncationOfARequestIsRefused) {
  const std::string proto(100, 'p');
  const std::string whole = EncodeRequest(ElementRequest{11, 12, proto});
  absl::StatusOr<ElementRequest> decoded = DecodeRequest(whole.data(), whole.size());
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->client_id, 11u);
  EXPECT_EQ(decoded->sequence, 12u);
  EXPECT_EQ(decoded->serialized_request, proto);
  for (size_t length = 0; length < whole.size(); ++length) {
    EXPECT_TRUE(absl::IsDataLoss(DecodeRequest(whole.data(), length).status())) << length;
  }
  const std::string longer = whole + "x";
  EXPECT_TRUE(absl::IsDataLoss(DecodeRequest(longer.data(), longer.size()).status()));
}

TEST(ElementMessage, TagsAreDistinctPerClientSequenceAndSlot) {
  ASSERT_TRUE(LoadCrypto().ok());
  std::set<std::pair<uint64_t, uint64_t>> seen = {{RequestTag().hi, RequestTag().lo}};
  for (uint64_t client : {1ull, 2ull, ~0ull}) {
    for (uint64_t sequence : {0ull, 1ull, 1ull << 40}) {
      for (uint32_t slot : {0u, 1u, kMaxComponents}) {
        const Tag tag = ResponseTag(client, sequence, slot);
        EXPECT_TRUE(seen.insert({tag.hi, tag.lo}).second) << client << " " << sequence << " " << slot;
      }
    }
  }
}

}  // namespace
}  // namespace tf_rdma
