#include "cc/tf/messages/tensor_message.h"

#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cc/transport/crypto.h"
#include "tensorflow/core/framework/tensor.pb.h"

namespace tf_rdma {
namespace {

constexpr uint32_t kHeaderMagic = 0x4d524654;  // "TFRM"

}  // namespace

void AppendLittleEndian(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t LoadLittleEndian64(const uint8_t* bytes) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  return v;
}

TransferTags TagsFor(std::string_view transfer, int64_t step_id) {
  // A cryptographic digest: tags of distinct transfers must not collide, whatever the names.
  const Sha256Digest digest = Sha256(absl::StrCat("tensor;", transfer, ";", step_id));
  const uint64_t hi = LoadLittleEndian64(digest.data());
  const uint64_t lo = LoadLittleEndian64(digest.data() + 8) & ~uint64_t{1};
  return TransferTags{Tag{hi, lo}, Tag{hi, lo | 1}};
}

Tag CollectiveTag(std::string_view key, int64_t step_id, std::string_view from_device,
                  std::string_view to_device) {
  const Sha256Digest digest =
      Sha256(absl::StrCat("collective;", key, ";", step_id, ";", from_device, ";", to_device));
  return Tag{LoadLittleEndian64(digest.data()), LoadLittleEndian64(digest.data() + 8)};
}

Tag FusedTag(uint64_t group, int64_t step_id, std::string_view from_device, std::string_view to_device) {
  const Sha256Digest digest =
      Sha256(absl::StrCat("fused;", group, ";", step_id, ";", from_device, ";", to_device));
  return Tag{LoadLittleEndian64(digest.data()), LoadLittleEndian64(digest.data() + 8)};
}

bool TravelsAsBytes(tensorflow::DataType dtype) {
  return !tensorflow::IsRefType(dtype) && tensorflow::DataTypeCanUseMemcpy(dtype);
}

bool TravelsInline(const TensorHeader& header) { return header.dead || header.data_bytes <= kInlineBytes; }

std::string EncodeHeader(const TensorHeader& header, uint64_t room) {
  std::string out;
  out.reserve(24 + 8 * header.shape.dims() + room);
  AppendLittleEndian(out, kHeaderMagic, 4);
  AppendLittleEndian(out, header.dead ? 1 : 0, 4);
  AppendLittleEndian(out, static_cast<uint32_t>(header.dtype), 4);
  AppendLittleEndian(out, static_cast<uint32_t>(header.shape.dims()), 4);
  AppendLittleEndian(out, header.data_bytes, 8);
  for (int i = 0; i < header.shape.dims(); ++i) AppendLittleEndian(out, static_cast<uint64_t>(header.shape.dim_size(i)), 8);
  return out;
}

absl::StatusOr<TensorHeader> DecodeHeader(const char* bytes, uint64_t length, uint64_t* data_offset) {
  const auto* in = reinterpret_cast<const uint8_t*>(bytes);
  auto malformed = [](const std::string& why) {
    return absl::DataLossError(absl::StrCat("malformed tensor header from the peer: ", why));
  };
  if (length < 24) return malformed(absl::StrCat(length, " bytes"));
  if (static_cast<uint32_t>(LoadLittleEndian64(in)) != kHeaderMagic) return malformed("bad magic");
  TensorHeader header;
  header.dead = (LoadLittleEndian64(in + 4) & 0xffffffff) != 0;
  *data_offset = 24;
  if (header.dead) return header;
  header.dtype = static_cast<tensorflow::DataType>(LoadLittleEndian64(in + 8) & 0xffffffff);
  const uint64_t dims = LoadLittleEndian64(in + 12) & 0xffffffff;
  header.data_bytes = LoadLittleEndian64(in + 16);
  if (!tensorflow::DataType_IsValid(header.dtype) || header.dtype == tensorflow::DT_INVALID ||
      tensorflow::IsRefType(header.dtype)) {
    return malformed(absl::StrCat("dtype ", static_cast<int>(header.dtype)));
  }
  if (dims > static_cast<uint64_t>(tensorflow::TensorShape::MaxDimensions())) {
    return malformed(absl::StrCat(dims, " dimensions"));
  }
  *data_offset = 24 + 8 * dims;
  const uint64_t inline_bytes = TravelsInline(header) ? header.data_bytes : 0;
  if (length != *data_offset + inline_bytes) {
    return malformed(absl::StrCat(dims, " dimensions and ", inline_bytes, " inline bytes in ", length, " bytes"));
  }
  for (uint64_t i = 0; i < dims; ++i) {
    const auto size = static_cast<int64_t>(LoadLittleEndian64(in + 24 + 8 * i));
    absl::Status added = header.shape.AddDimWithStatus(size);
    if (!added.ok()) return malformed(std::string(added.message()));
  }
  // A TensorProto: its parser checks it, and cannot take more than INT_MAX bytes, so a peer's
  // header asking for more must not size a grant. Each of its strings or variants takes at least a
  // byte, so a small message cannot make us allocate a large tensor.
  if (!TravelsAsBytes(header.dtype)) {
    if (header.data_bytes > static_cast<uint64_t>(INT_MAX)) {
      return malformed(absl::StrCat(header.data_bytes, " bytes of TensorProto"));
    }
    if (static_cast<uint64_t>(header.shape.num_elements()) > header.data_bytes) {
      return malformed(absl::StrCat(header.shape.num_elements(), " ", tensorflow::DataTypeString(header.dtype),
                                    " elements in ", header.data_bytes, " bytes"));
    }
    return header;
  }
  const uint64_t element_size = tensorflow::DataTypeSize(header.dtype);
  uint64_t total = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(header.shape.num_elements()), element_size, &total) ||
      total != header.data_bytes) {
    return malformed(absl::StrCat("shape ", header.shape.DebugString(), " does not hold ",
                                  header.data_bytes, " bytes"));
  }
  return header;
}

absl::StatusOr<tensorflow::Tensor> TensorFromProtoBytes(const TensorHeader& header, std::string_view bytes) {
  auto malformed = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("the peer's ", tensorflow::DataTypeString(header.dtype),
                                            " tensor does not parse as its header announced: ", why));
  };
  tensorflow::TensorProto proto;
  if (bytes.size() != header.data_bytes || bytes.size() > static_cast<uint64_t>(INT_MAX) ||
      !proto.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return malformed(absl::StrCat(bytes.size(), " bytes that are not a TensorProto of ", header.data_bytes));
  }
  // Tensor::FromProto allocates the proto's shape before it reads a value: it must be the header's,
  // which DecodeHeader bounded by the message's bytes.
  tensorflow::TensorShape shape;
  if (proto.dtype() != header.dtype || !tensorflow::TensorShape::BuildTensorShape(proto.tensor_shape(), &shape).ok() ||
      shape != header.shape) {
    return malformed(absl::StrCat("a TensorProto of ", tensorflow::DataTypeString(proto.dtype()), " ",
                                  proto.tensor_shape().ShortDebugString(), " for ", header.shape.DebugString()));
  }
  tensorflow::Tensor tensor;
  if (!tensor.FromProto(tensorflow::cpu_allocator(), proto)) return malformed("its values do not match its shape");
  return tensor;
}

constexpr uint64_t kSlotLengthBytes = 8;

uint64_t FusedSlotCapacity(int dims, uint64_t data_bytes) {
  const uint64_t bytes = kSlotLengthBytes + 24 + 8 * static_cast<uint64_t>(dims) + data_bytes;
  return (bytes + 7) & ~uint64_t{7};  // the next slot's length stays aligned
}

bool FillFusedSlot(char* slot, uint64_t capacity, const TensorHeader& header, const char* data) {
  const std::string head = EncodeHeader(header);
  const uint64_t inline_bytes = header.dead ? 0 : header.data_bytes;
  const bool fits = !header.dead && TravelsAsBytes(header.dtype) && TravelsInline(header) &&
                    capacity >= kSlotLengthBytes + head.size() + inline_bytes;
  const uint64_t length = fits ? head.size() + inline_bytes : 0;
  std::string encoded_length;
  AppendLittleEndian(encoded_length, length, kSlotLengthBytes);
  std::memcpy(slot, encoded_length.data(), kSlotLengthBytes);
  if (fits) {
    std::memcpy(slot + kSlotLengthBytes, head.data(), head.size());
    if (inline_bytes != 0) std::memcpy(slot + kSlotLengthBytes + head.size(), data, inline_bytes);
  }
  std::memset(slot + kSlotLengthBytes + length, 0, capacity - kSlotLengthBytes - length);
  return fits;
}

absl::StatusOr<std::string_view> ReadFusedSlot(const char* slot, uint64_t capacity) {
  if (capacity < kSlotLengthBytes) {
    return absl::InternalError(absl::StrCat("a fused slot of ", capacity, " bytes"));
  }
  const uint64_t length = LoadLittleEndian64(reinterpret_cast<const uint8_t*>(slot));
  if (length > capacity - kSlotLengthBytes) {
    return absl::DataLossError(absl::StrCat("malformed fused message from the peer: a member of ", length,
                                            " bytes in a slot of ", capacity));
  }
  return std::string_view(slot + kSlotLengthBytes, length);
}

}  // namespace tf_rdma
