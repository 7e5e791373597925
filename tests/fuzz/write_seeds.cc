// Writes the seed corpora of the fuzz targets whose inputs are messages (tests/fuzz/corpus/<target>/
// seed-*), each made by the encoder the real sender uses: `make fuzz-seeds` after a format changed.
// The targets whose inputs are scripts of operations (grant_book, stream_connection) have corpora
// kept from fuzzing runs instead.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/tf/data/element_message.h"
#include "cc/tf/messages/call_message.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/transport/wire.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor.pb.h"

namespace {

using tensorflow::Tensor;
using tensorflow::TensorShape;
using tf_rdma::wire::Frame;
using tf_rdma::wire::FrameType;

std::filesystem::path root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::filesystem::path dir = root / target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / ("seed-" + name), std::ios::binary) << bytes;
}

tf_rdma::wire::Greeting Greeting(const std::string& name, tf_rdma::Backend backend) {
  tf_rdma::wire::Greeting greeting;
  greeting.backend = static_cast<uint8_t>(backend);
  greeting.nonce.fill(0x5a);
  greeting.name = name;
  greeting.build = "0.1.0, TensorFlow 2.21.0";
  return greeting;
}

std::vector<Frame> EveryFrame() {
  const tf_rdma::Tag tag{0x1234, 0x5678};
  return {
      {FrameType::kHello, Greeting("/job:worker/replica:0/task:1", tf_rdma::Backend::kTcp)},
      {FrameType::kChallenge, Greeting("/job:ps/replica:0/task:0", tf_rdma::Backend::kShm)},
      {FrameType::kProof, tf_rdma::wire::Proof{}},
      {FrameType::kAccept, tf_rdma::wire::Accept{}},
      {FrameType::kReject, tf_rdma::wire::Reject{14, "the listener is busy\n"}},
      {FrameType::kGrant, tf_rdma::wire::Grant{7, tag, 1, 4096, 65536}},
      {FrameType::kData, tf_rdma::wire::Data{7, 1000}},
      {FrameType::kTooSmall, tf_rdma::wire::TooSmall{7, 1 << 20}},
      {FrameType::kRevoke, tf_rdma::wire::Revoke{7}},
      {FrameType::kRevoked, tf_rdma::wire::Revoked{7}},
      {FrameType::kPing, tf_rdma::wire::Ping{}},
      {FrameType::kShmRegion, tf_rdma::wire::ShmRegion{1, 1 << 20}},
      {FrameType::kDiscard, tf_rdma::wire::Discard{tag}},
      {FrameType::kShmRegionGone, tf_rdma::wire::ShmRegionGone{1}},
      {FrameType::kWithdrawn, tf_rdma::wire::Withdrawn{7, 10, "the step was aborted"}},
  };
}

void WireSeeds() {
  std::string stream;
  for (const Frame& frame : EveryFrame()) {
    const std::string bytes = tf_rdma::wire::Encode(frame);
    Write("wire", tf_rdma::wire::FrameTypeName(frame.type), bytes);
    stream += bytes;
  }
  Write("wire", "every-frame", stream);
}

void HandshakeSeeds() {
  // The first byte's flags: handshake_fuzz.cc. The peer's tokens are forged by the harness (flag 2).
  for (const auto backend : {tf_rdma::Backend::kTcp, tf_rdma::Backend::kShm}) {
    const char backend_flag = backend == tf_rdma::Backend::kShm ? 4 : 0;
    const std::string name = tf_rdma::BackendName(backend);
    Write("handshake", "initiator-" + name,
          std::string(1, 1 | 2 | backend_flag) +
              tf_rdma::wire::Encode({FrameType::kChallenge, Greeting("/job:ps/replica:0/task:0", backend)}) +
              tf_rdma::wire::Encode({FrameType::kAccept, tf_rdma::wire::Accept{}}));
    Write("handshake", "responder-" + name,
          std::string(1, 2 | backend_flag) +
              tf_rdma::wire::Encode({FrameType::kHello, Greeting("/job:ps/replica:0/task:0", backend)}) +
              tf_rdma::wire::Encode({FrameType::kProof, tf_rdma::wire::Proof{}}));
  }
  Write("handshake", "rejected",
        std::string(1, 1) + tf_rdma::wire::Encode({FrameType::kReject, tf_rdma::wire::Reject{14, "not now"}}));
}

Tensor FloatTensor(TensorShape shape) {
  Tensor tensor(tensorflow::DT_FLOAT, shape);
  auto values = tensor.flat<float>();
  for (int64_t i = 0; i < values.size(); ++i) values(i) = 0.5f * i;
  return tensor;
}

Tensor StringTensor() {
  Tensor tensor(tensorflow::DT_STRING, TensorShape({3}));
  tensor.flat<tensorflow::tstring>()(0) = "a";
  tensor.flat<tensorflow::tstring>()(1) = "";
  tensor.flat<tensorflow::tstring>()(2) = "tf_rdma";
  return tensor;
}

// The header message of `tensor` as the rendezvous sends it, and its header.
std::string HeaderMessage(const Tensor& tensor, tf_rdma::TensorHeader* header) {
  header->dtype = tensor.dtype();
  header->shape = tensor.shape();
  std::string data;
  if (tf_rdma::TravelsAsBytes(tensor.dtype())) {
    data = std::string(tensor.tensor_data());
  } else {
    tensorflow::TensorProto proto;
    tensor.AsProtoTensorContent(&proto);
    data = proto.SerializeAsString();
  }
  header->data_bytes = data.size();
  std::string message = tf_rdma::EncodeHeader(*header);
  if (tf_rdma::TravelsInline(*header)) message += data;
  return message;
}

void TensorSeeds() {
  tf_rdma::TensorHeader header;
  Write("tensor_message", "float-2x3", HeaderMessage(FloatTensor(TensorShape({2, 3})), &header));
  Write("tensor_message", "float-scalar", HeaderMessage(FloatTensor(TensorShape({})), &header));
  Write("tensor_message", "float-large", HeaderMessage(FloatTensor(TensorShape({64, 1024})), &header));
  Write("tensor_message", "string", HeaderMessage(StringTensor(), &header));
  tf_rdma::TensorHeader dead;
  dead.dead = true;
  Write("tensor_message", "dead", tf_rdma::EncodeHeader(dead));
}

// The fuzz target's first byte picks the decoder: 0 a request slot's, 1 a reply's.
void CallSeeds() {
  using tf_rdma::CallFrame;
  using tf_rdma::CallRequestHeader;
  const std::string small(40, 'r');
  Write("call_message", "request-inline",
        std::string(1, 0) + tf_rdma::EncodeCallRequest(CallRequestHeader{CallFrame::kRequest, 6, 7, small.size()}, small));
  Write("call_message", "request-with-body",
        std::string(1, 0) + tf_rdma::EncodeCallRequest(CallRequestHeader{CallFrame::kRequest, 4, 8, 1 << 16}, {}));
  Write("call_message", "cancel",
        std::string(1, 0) + tf_rdma::EncodeCallRequest(CallRequestHeader{CallFrame::kCancel, 6, 7, 0}, {}));
  Write("call_message", "reply-ok", std::string(1, 1) + tf_rdma::EncodeCallReply(absl::OkStatus(), "reply"));
  absl::Status failed = absl::AbortedError("step 12 was cancelled");
  failed.SetPayload("type.googleapis.com/tensorflow.DerivedStatus", absl::Cord(""));
  Write("call_message", "reply-error", std::string(1, 1) + tf_rdma::EncodeCallReply(failed, {}));
}

void ElementSeeds() {
  Write("element_message", "request",
        tf_rdma::EncodeRequest({42, 7, std::string_view("\x08\x01\x10\x02", 4)}));
  tensorflow::data::GetElementResult result;
  result.components.push_back(FloatTensor(TensorShape({4})));
  result.components.push_back(StringTensor());
  result.element_index = 3;
  Write("element_message", "response", tf_rdma::EncodeResponse(absl::OkStatus(), result).header_message);
  tensorflow::data::GetElementResult large;
  large.components.push_back(FloatTensor(TensorShape({64, 1024})));
  Write("element_message", "response-separate", tf_rdma::EncodeResponse(absl::OkStatus(), large).header_message);
  tensorflow::data::GetElementResult end;
  end.end_of_sequence = true;
  Write("element_message", "end-of-sequence", tf_rdma::EncodeResponse(absl::OkStatus(), end).header_message);
  Write("element_message", "error",
        tf_rdma::EncodeResponse(absl::UnavailableError("the worker is gone"), end).header_message);
}

void FusedSeeds() {
  // Two members, as cc/tf/planning/fusion.cc plans them: slots one after the other.
  const Tensor members[2] = {FloatTensor(TensorShape({2, 2})), FloatTensor(TensorShape({5}))};
  uint64_t total = 0;
  for (const Tensor& tensor : members) total += tf_rdma::FusedSlotCapacity(tensor.dims(), tensor.TotalBytes());
  std::string message(total, '\0');
  uint64_t offset = 0;
  for (int i = 0; i < 2; ++i) {
    tf_rdma::TensorHeader header;
    HeaderMessage(members[i], &header);
    const uint64_t capacity = tf_rdma::FusedSlotCapacity(members[i].dims(), members[i].TotalBytes());
    tf_rdma::FillFusedSlot(message.data() + offset, capacity, header, members[i].tensor_data().data());
    const std::string name = absl::StrCat("edge_5_y;0:0/rdma_fuse:9876543210:", i, ":2:", offset, ":", capacity, ":", total);
    Write("fused_message", absl::StrCat("member-", i), name + std::string(1, '\0') + message);
    offset += capacity;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus directory>\n", argv[0]);
    return 2;
  }
  root = argv[1];
  WireSeeds();
  HandshakeSeeds();
  TensorSeeds();
  CallSeeds();
  ElementSeeds();
  FusedSeeds();
  return 0;
}
