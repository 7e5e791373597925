#include "cc/transport/wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tf_rdma::wire {
namespace {

class ByteWriter {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Little(v, 2); }
  void U32(uint32_t v) { Little(v, 4); }
  void U64(uint64_t v) { Little(v, 8); }
  template <size_t N>
  void Bytes(const std::array<uint8_t, N>& bytes) {
    out_.append(reinterpret_cast<const char*>(bytes.data()), N);
  }
  void String(const std::string& s) {
    U16(static_cast<uint16_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  void Little(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

// A peer's text (its name, a REJECT's reason) ends up in logs, errors and Python strings: bytes
// outside printable ASCII become \xNN, so a peer can neither forge log lines (newlines) nor make
// the text invalid UTF-8. Task names and our own messages are printable ASCII and pass unchanged.
std::string EscapeUnprintable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(byte, absl::kZeroPad2));
    }
  }
  return out;
}

// Reads fields off an untrusted body; after the first short read every later read fails too.
class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  uint8_t U8() { return static_cast<uint8_t>(Little(1)); }
  uint16_t U16() { return static_cast<uint16_t>(Little(2)); }
  uint32_t U32() { return static_cast<uint32_t>(Little(4)); }
  uint64_t U64() { return Little(8); }
  template <size_t N>
  void Bytes(std::array<uint8_t, N>& out) {
    if (!Have(N)) return;
    std::memcpy(out.data(), in_.data(), N);
    in_.remove_prefix(N);
  }
  // Exactly the bytes sent; for anything shown to a person, String().
  std::string RawString(size_t max_length) {
    const uint16_t length = U16();
    if (length > max_length) {
      error_ = absl::StrCat("string of ", length, " bytes exceeds the limit of ", max_length);
      return {};
    }
    if (!Have(length)) return {};
    std::string s(in_.substr(0, length));
    in_.remove_prefix(length);
    return s;
  }
  std::string String(size_t max_length) { return EscapeUnprintable(RawString(max_length)); }
  absl::Status Finish(FrameType type) const {
    if (error_.empty() && !in_.empty()) {
      return absl::DataLossError(absl::StrCat("malformed ", FrameTypeName(type), " frame: ",
                                              in_.size(), " trailing bytes"));
    }
    if (!error_.empty()) {
      return absl::DataLossError(absl::StrCat("malformed ", FrameTypeName(type), " frame: ", error_));
    }
    return absl::OkStatus();
  }

 private:
  bool Have(size_t n) {
    if (!error_.empty()) return false;
    if (in_.size() < n) {
      error_ = absl::StrCat("truncated: needs ", n, " more bytes, has ", in_.size());
      return false;
    }
    return true;
  }
  uint64_t Little(int n) {
    if (!Have(n)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    in_.remove_prefix(n);
    return v;
  }
  std::string_view in_;
  std::string error_;
};

void EncodeBody(const Greeting& g, ByteWriter& w) {
  w.U32(g.protocol_version);
  w.U8(g.backend);
  w.Bytes(g.nonce);
  w.String(NameOnWire(g.name));
  w.String(g.build.substr(0, kMaxNameLength));
}

Greeting DecodeGreeting(ByteReader& r) {
  Greeting g;
  g.protocol_version = r.U32();
  g.backend = r.U8();
  r.Bytes(g.nonce);
  g.name_on_wire = r.RawString(kMaxNameLength);
  g.name = EscapeUnprintable(g.name_on_wire);
  g.build = r.String(kMaxNameLength);
  return g;
}

// PROOF and ACCEPT: a MAC and nothing else.
template <typename Body>
Body DecodeMac(ByteReader& r) {
  Body body;
  r.Bytes(body.mac);
  return body;
}

}  // namespace

std::string NameOnWire(const std::string& name) { return name.substr(0, kMaxNameLength); }

const char* FrameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kHello: return "HELLO";
    case FrameType::kChallenge: return "CHALLENGE";
    case FrameType::kProof: return "PROOF";
    case FrameType::kAccept: return "ACCEPT";
    case FrameType::kReject: return "REJECT";
    case FrameType::kGrant: return "GRANT";
    case FrameType::kData: return "DATA";
    case FrameType::kTooSmall: return "TOO_SMALL";
    case FrameType::kRevoke: return "REVOKE";
    case FrameType::kRevoked: return "REVOKED";
    case FrameType::kPing: return "PING";
    case FrameType::kShmRegion: return "SHM_REGION";
    case FrameType::kDiscard: return "DISCARD";
    case FrameType::kShmRegionGone: return "SHM_REGION_GONE";
    case FrameType::kWithdrawn: return "WITHDRAWN";
  }
  return "UNKNOWN";
}

absl::StatusOr<Header> DecodeHeader(std::string_view bytes) {
  if (bytes.size() != kHeaderLength) {
    return absl::DataLossError(absl::StrCat("frame header must be ", kHeaderLength, " bytes, got ",
                                            bytes.size()));
  }
  const uint8_t type = static_cast<uint8_t>(bytes[0]);
  if (type < static_cast<uint8_t>(FrameType::kHello) ||
      type > static_cast<uint8_t>(FrameType::kWithdrawn)) {
    return absl::DataLossError(absl::StrCat("unknown frame type ", type));
  }
  if (bytes[1] != 0 || bytes[2] != 0 || bytes[3] != 0) {
    return absl::DataLossError("malformed frame header: reserved bytes are not zero");
  }
  uint32_t length = 0;
  for (int i = 0; i < 4; ++i) length |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[4 + i])) << (8 * i);
  if (length > kMaxBodyLength) {
    return absl::DataLossError(absl::StrCat("frame body of ", length, " bytes exceeds the limit of ",
                                            kMaxBodyLength));
  }
  return Header{static_cast<FrameType>(type), length};
}

absl::StatusOr<Frame> DecodeBody(FrameType type, std::string_view body) {
  ByteReader r(body);
  Frame frame{type, Ping{}};
  switch (type) {
    case FrameType::kHello:
    case FrameType::kChallenge:
      frame.body = DecodeGreeting(r);
      break;
    case FrameType::kProof:
      frame.body = DecodeMac<Proof>(r);
      break;
    case FrameType::kAccept:
      frame.body = DecodeMac<Accept>(r);
      break;
    case FrameType::kReject: {
      Reject rej;
      rej.code = r.U32();
      rej.message = r.String(kMaxBodyLength);
      frame.body = rej;
      break;
    }
    case FrameType::kGrant: {
      Grant g;
      g.grant_id = r.U64();
      g.tag.hi = r.U64();
      g.tag.lo = r.U64();
      g.region_id = r.U32();
      g.offset = r.U64();
      g.capacity = r.U64();
      frame.body = g;
      break;
    }
    case FrameType::kData: {
      Data d;
      d.grant_id = r.U64();
      d.length = r.U64();
      frame.body = d;
      break;
    }
    case FrameType::kTooSmall: {
      TooSmall t;
      t.grant_id = r.U64();
      t.needed = r.U64();
      frame.body = t;
      break;
    }
    case FrameType::kRevoke:
      frame.body = Revoke{r.U64()};
      break;
    case FrameType::kRevoked:
      frame.body = Revoked{r.U64()};
      break;
    case FrameType::kPing:
      frame.body = Ping{};
      break;
    case FrameType::kDiscard: {
      Discard d;
      d.tag.hi = r.U64();
      d.tag.lo = r.U64();
      frame.body = d;
      break;
    }
    case FrameType::kShmRegion: {
      ShmRegion s;
      s.region_id = r.U32();
      s.size = r.U64();
      frame.body = s;
      break;
    }
    case FrameType::kShmRegionGone:
      frame.body = ShmRegionGone{r.U32()};
      break;
    case FrameType::kWithdrawn: {
      Withdrawn w;
      w.grant_id = r.U64();
      w.code = r.U32();
      w.reason = r.String(kMaxWithdrawnReasonLength);
      frame.body = std::move(w);
      break;
    }
    default:
      return absl::DataLossError(absl::StrCat("unknown frame type ", static_cast<int>(type)));
  }
  absl::Status status = r.Finish(type);
  if (!status.ok()) return status;
  if (const auto* withdrawn = std::get_if<Withdrawn>(&frame.body)) {
    // A status code other than OK: the receiver's grant fails with it.
    if (withdrawn->code == 0 ||
        withdrawn->code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
      return absl::DataLossError(absl::StrCat("malformed WITHDRAWN frame: status code ",
                                              withdrawn->code, " is not an error code"));
    }
  }
  return frame;
}

std::string Encode(const Frame& frame) {
  ByteWriter body;
  std::visit(
      [&](const auto& b) {
        using T = std::decay_t<decltype(b)>;
        if constexpr (std::is_same_v<T, Greeting>) {
          EncodeBody(b, body);
        } else if constexpr (std::is_same_v<T, Proof> || std::is_same_v<T, Accept>) {
          body.Bytes(b.mac);
        } else if constexpr (std::is_same_v<T, Reject>) {
          body.U32(b.code);
          body.String(b.message.substr(0, kMaxBodyLength - 6));
        } else if constexpr (std::is_same_v<T, Grant>) {
          body.U64(b.grant_id);
          body.U64(b.tag.hi);
          body.U64(b.tag.lo);
          body.U32(b.region_id);
          body.U64(b.offset);
          body.U64(b.capacity);
        } else if constexpr (std::is_same_v<T, Data>) {
          body.U64(b.grant_id);
          body.U64(b.length);
        } else if constexpr (std::is_same_v<T, TooSmall>) {
          body.U64(b.grant_id);
          body.U64(b.needed);
        } else if constexpr (std::is_same_v<T, Revoke> || std::is_same_v<T, Revoked>) {
          body.U64(b.grant_id);
        } else if constexpr (std::is_same_v<T, ShmRegion>) {
          body.U32(b.region_id);
          body.U64(b.size);
        } else if constexpr (std::is_same_v<T, Discard>) {
          body.U64(b.tag.hi);
          body.U64(b.tag.lo);
        } else if constexpr (std::is_same_v<T, ShmRegionGone>) {
          body.U32(b.region_id);
        } else if constexpr (std::is_same_v<T, Withdrawn>) {
          body.U64(b.grant_id);
          body.U32(b.code);
          body.String(b.reason.substr(0, kMaxWithdrawnReasonLength));
        }
      },
      frame.body);
  const std::string payload = body.Take();
  ByteWriter header;
  header.U8(static_cast<uint8_t>(frame.type));
  header.U8(0);
  header.U16(0);
  header.U32(static_cast<uint32_t>(payload.size()));
  return header.Take() + payload;
}

}  // namespace tf_rdma::wire
