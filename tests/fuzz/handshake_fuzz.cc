// The handshake (cc/transport/handshake.h) in either role against a peer whose frames are the
// fuzzer's. A flag lets the harness put the right token in the peer's PROOF or ACCEPT (it knows
// the key and sees both nonces), so the fuzzer reaches what follows a valid proof too: the
// listener's admission, the identity returned. Without it no input may complete a handshake.
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cc/transport/crypto.h"
#include "cc/transport/handshake.h"
#include "cc/transport/wire.h"

namespace {

using tf_rdma::wire::Frame;
using tf_rdma::wire::FrameType;

constexpr char kKey[] = "the cluster key of the process under test";

[[noreturn]] void Fail(const char* why) {
  __builtin_printf("handshake_fuzz: %s\n", why);
  std::abort();
}

// The peer: its frames are the input's bytes after the first, as they would come off the wire.
class FuzzedPeer : public tf_rdma::FrameChannel {
 public:
  FuzzedPeer(std::string_view wire, bool local_initiates, bool forge_tokens, int failing_send)
      : wire_(wire), local_initiates_(local_initiates), forge_tokens_(forge_tokens), failing_send_(failing_send) {}

  absl::Status Send(const Frame& frame) override {
    sent_.push_back(frame);
    if (const auto* greeting = std::get_if<tf_rdma::wire::Greeting>(&frame.body)) own_greeting_ = *greeting;
    if (static_cast<int>(sent_.size()) == failing_send_) return absl::UnavailableError("the fuzzed peer hung up");
    return absl::OkStatus();
  }

  absl::StatusOr<Frame> Receive(absl::Time) override {
    if (wire_.size() < tf_rdma::wire::kHeaderLength) return absl::UnavailableError("the fuzzed peer closed");
    absl::StatusOr<tf_rdma::wire::Header> header = tf_rdma::wire::DecodeHeader(wire_.substr(0, tf_rdma::wire::kHeaderLength));
    if (!header.ok()) return header.status();
    wire_.remove_prefix(tf_rdma::wire::kHeaderLength);
    if (wire_.size() < header->body_length) return absl::UnavailableError("the fuzzed peer closed mid-frame");
    absl::StatusOr<Frame> frame = tf_rdma::wire::DecodeBody(header->type, wire_.substr(0, header->body_length));
    wire_.remove_prefix(header->body_length);
    if (!frame.ok()) return frame.status();
    if (const auto* greeting = std::get_if<tf_rdma::wire::Greeting>(&frame->body)) peer_greeting_ = *greeting;
    if (forge_tokens_ && own_greeting_ && peer_greeting_) {
      if (auto* proof = std::get_if<tf_rdma::wire::Proof>(&frame->body)) {
        proof->mac = Token(tf_rdma::TokenDirection::kInitiatorToResponder);
      } else if (auto* accept = std::get_if<tf_rdma::wire::Accept>(&frame->body)) {
        accept->mac = Token(tf_rdma::TokenDirection::kResponderToInitiator);
      }
    }
    return frame;
  }

  std::string PeerAddress() const override { return "fuzzed peer"; }
  const std::vector<Frame>& sent() const { return sent_; }

 private:
  tf_rdma::wire::Mac Token(tf_rdma::TokenDirection direction) const {
    const tf_rdma::wire::Greeting& initiator = local_initiates_ ? *own_greeting_ : *peer_greeting_;
    const tf_rdma::wire::Greeting& responder = local_initiates_ ? *peer_greeting_ : *own_greeting_;
    const auto name = [](const tf_rdma::wire::Greeting& g) {
      return g.name_on_wire.empty() ? tf_rdma::wire::NameOnWire(g.name) : g.name_on_wire;
    };
    return tf_rdma::HandshakeToken(
        kKey, direction,
        {own_greeting_->protocol_version, static_cast<tf_rdma::Backend>(own_greeting_->backend), name(initiator),
         name(responder), initiator.nonce, responder.nonce});
  }

  std::string_view wire_;
  const bool local_initiates_;
  const bool forge_tokens_;
  const int failing_send_;  // 1-based; 0: none fails
  std::vector<Frame> sent_;
  std::optional<tf_rdma::wire::Greeting> own_greeting_;
  std::optional<tf_rdma::wire::Greeting> peer_greeting_;
};

bool Printable(const std::string& text) {
  for (const char c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (!tf_rdma::LoadCrypto().ok()) Fail("libcrypto does not load");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte: bit 0 the role, bit 1 whether the harness forges the peer's tokens, bit 2 the
  // backend, bits 3-4 the listener's verdict, bits 5-6 which of this process's sends fails.
  const uint8_t flags = data[0];
  const bool local_initiates = flags & 1;
  const bool forge_tokens = flags & 2;
  const auto backend = flags & 4 ? tf_rdma::Backend::kShm : tf_rdma::Backend::kTcp;
  const int verdict = (flags >> 3) & 3;
  const int failing_send = (flags >> 5) & 3;
  tf_rdma::TransportOptions options;
  options.local_name = "/job:worker/replica:0/task:0";
  options.cluster_key = kKey;
  bool admitted = false;
  const tf_rdma::AdmitCallback admit = [&](const std::string& name) -> absl::Status {
    if (!Printable(name)) Fail("admission asked about an unescaped name");
    if (verdict == 1) return absl::UnavailableError("not now");
    if (verdict >= 2) return absl::PermissionDeniedError(std::string(2000, 'x'));
    admitted = true;
    return absl::OkStatus();
  };

  FuzzedPeer peer(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1), local_initiates,
                  forge_tokens, failing_send);
  absl::StatusOr<tf_rdma::PeerIdentity> identity =
      local_initiates ? tf_rdma::ClientHandshake(peer, backend, options)
                      : tf_rdma::ServerHandshake(peer, backend, options, admit);
  const std::vector<Frame>& sent = peer.sent();
  for (size_t i = 0; i + 1 < sent.size(); ++i) {
    if (sent[i].type == FrameType::kReject) Fail("a frame followed a REJECT");
  }
  if (!identity.ok()) {
    for (const Frame& frame : sent) {
      if (frame.type == FrameType::kAccept) {
        if (!admitted) Fail("ACCEPT sent to a peer the listener did not admit");
      }
    }
    return 0;
  }
  if (!forge_tokens) Fail("a handshake completed without the key");
  if (!Printable(identity->name) || !Printable(identity->build)) Fail("the peer's identity is not escaped");
  const FrameType expected[2] = {local_initiates ? FrameType::kHello : FrameType::kChallenge,
                                 local_initiates ? FrameType::kProof : FrameType::kAccept};
  if (sent.size() != 2 || sent[0].type != expected[0] || sent[1].type != expected[1]) {
    Fail("a completed handshake sent other frames than its role's two");
  }
  if (!local_initiates && !admitted) Fail("a listener completed a handshake it did not admit");
  return 0;
}
