#include "cc/transport/handshake.h"

#include <memory>
#include <mutex>
#include <map>
#include <string_view>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/crypto.h"
#include "cc/transport/error_kinds.h"

#ifndef TF_RDMA_VERSION
#define TF_RDMA_VERSION "dev"
#endif

namespace tf_rdma {
namespace {

// Marks a ClientHandshake's failure as the listener's "not now" or "busy" (RefusedForNow).
constexpr char kRefusedForNowPayload[] = "tf_rdma/listener-refused-for-now";
// What of a listener's admission reason travels: enough for a sentence naming two tasks, so a
// refusal costs the dialer (which may retry for the whole connect timeout) little to carry.
constexpr size_t kMaxAdmissionReasonLength = 1024;

// The nonces of handshakes this process is running, in either role, with the name each was issued
// under. A peer that sends back one issued under the name it is talking to is relaying that
// party's own handshake to it (a listener squatting on an address the process dials, forwarding to
// the process's own listener): refused on sight, whatever else it sends. The tokens alone would
// fail such an exchange; this names the cause. (Two parties of one process with distinct names
// may connect to each other: their nonces are in flight in the same process, legitimately.)
class InFlightNonces {
 public:
  static InFlightNonces& Get() {
    static InFlightNonces* nonces = new InFlightNonces;
    return *nonces;
  }
  void Add(const wire::Nonce& nonce, const std::string& issuer) {
    std::lock_guard<std::mutex> lock(mu_);
    issuers_.emplace(nonce, issuer);
  }
  void Remove(const wire::Nonce& nonce) {
    std::lock_guard<std::mutex> lock(mu_);
    issuers_.erase(nonce);
  }
  bool IssuedBy(const wire::Nonce& nonce, const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = issuers_.find(nonce);
    return found != issuers_.end() && found->second == name;
  }

 private:
  mutable std::mutex mu_;
  std::map<wire::Nonce, std::string> issuers_;
};

// A fresh nonce, in InFlightNonces for as long as this object lives (the handshake's duration).
class OwnNonce {
 public:
  static absl::StatusOr<std::unique_ptr<OwnNonce>> Draw(const std::string& issuer) {
    auto own = std::unique_ptr<OwnNonce>(new OwnNonce);
    absl::Status drawn = RandomBytes(own->nonce_.data(), own->nonce_.size());
    if (!drawn.ok()) return drawn;
    InFlightNonces::Get().Add(own->nonce_, issuer);
    return own;
  }
  ~OwnNonce() { InFlightNonces::Get().Remove(nonce_); }
  const wire::Nonce& value() const { return nonce_; }

 private:
  OwnNonce() = default;
  wire::Nonce nonce_{};
};

uint32_t AnnouncedVersion(const TransportOptions& options) {
  return options.protocol_version_override ? options.protocol_version_override
                                           : wire::kProtocolVersion;
}

// What this process says of itself in its HELLO or CHALLENGE.
wire::Greeting OwnGreeting(const TransportOptions& options, uint32_t version, Backend backend,
                           const wire::Nonce& nonce) {
  wire::Greeting greeting;
  greeting.protocol_version = version;
  greeting.backend = static_cast<uint8_t>(backend);
  greeting.nonce = nonce;
  greeting.name = options.local_name;
  greeting.build = BuildDescription();
  return greeting;
}

absl::Status Refuse(FrameChannel& channel, absl::Status status) {
  wire::Reject reject{static_cast<uint32_t>(status.code()), std::string(status.message())};
  channel.Send(wire::Frame{wire::FrameType::kReject, reject}).IgnoreError();
  return status;
}

absl::Status VersionMismatch(const wire::Greeting& peer, const std::string& peer_address,
                             const TransportOptions& options) {
  return WithErrorKind(absl::FailedPreconditionError(absl::StrCat(
      "tf_rdma version mismatch with peer ", peer.name, " at ", peer_address,
      ": it speaks wire protocol ", peer.protocol_version, " (tf_rdma ", peer.build,
      "), this process (", options.local_name, ") speaks ", AnnouncedVersion(options), " (tf_rdma ",
      BuildDescription(), "). Install the same tf_rdma version in every task of the cluster.")),
      ErrorKind::kHandshake);
}

absl::Status KeyMismatch(const std::string& who, const std::string& peer_address) {
  return WithErrorKind(absl::PermissionDeniedError(absl::StrCat(
      "cluster key mismatch with ", who, " at ", peer_address,
      ": the peer does not belong to this cluster. Start every task with the same cluster spec "
      "and the same TF_RDMA_SECRET.")),
      ErrorKind::kHandshake);
}

// Expects a frame of `type`; a REJECT becomes the peer's error, anything else a protocol error.
// No REJECT is authenticated (only an ACCEPT carries a token), so its text is quoted as the words
// of whoever answered, and it asks for another attempt only in place of the frame where a
// legitimate listener refuses for now: "busy" (kResourceExhausted, no handshake slot free) in
// place of the CHALLENGE, "not now" (kUnavailable, its admission) in place of the ACCEPT. Any
// other REJECT ends the attempt as a hang-up does.
absl::StatusOr<wire::Frame> Expect(FrameChannel& channel, wire::FrameType type, absl::Time deadline) {
  absl::StatusOr<wire::Frame> frame = channel.Receive(deadline);
  if (!frame.ok()) {
    return WithContext(frame.status(), absl::StrCat("handshake with ", channel.PeerAddress(), " failed: ",
                                                    frame.status().message()));
  }
  if (frame->type == wire::FrameType::kReject) {
    const auto& reject = std::get<wire::Reject>(frame->body);
    const auto code = reject.code > 0 && reject.code <= 16 ? static_cast<absl::StatusCode>(reject.code)
                                                           : absl::StatusCode::kUnknown;
    absl::Status refused(code, absl::StrCat("handshake with ", channel.PeerAddress(), " refused: the peer at ",
                                            channel.PeerAddress(), ", not authenticated, said: ",
                                            reject.message));
    const bool for_now = (type == wire::FrameType::kChallenge && code == absl::StatusCode::kResourceExhausted) ||
                         (type == wire::FrameType::kAccept && code == absl::StatusCode::kUnavailable);
    // Any other REJECT ends the handshake for good: the peer will not take this process.
    if (for_now) {
      refused.SetPayload(kRefusedForNowPayload, absl::Cord());
    } else {
      refused = WithErrorKind(std::move(refused), ErrorKind::kHandshake);
    }
    return refused;
  }
  if (frame->type != type) {
    return absl::DataLossError(absl::StrCat("handshake with ", channel.PeerAddress(), ": expected ",
                                            wire::FrameTypeName(type), ", got ",
                                            wire::FrameTypeName(frame->type)));
  }
  return frame;
}

// A peer that claims this process's own name, or sends back one of the nonces it has in flight
// under that name (an initiator's own HELLO's among them), is this process talking to itself
// through a relay (or a task dialling its own address): never a peer.
absl::Status CheckNotReflected(const wire::Greeting& peer, const std::string& peer_address,
                               const TransportOptions& options) {
  const char* reflected = nullptr;
  if (InFlightNonces::Get().IssuedBy(peer.nonce, options.local_name)) {
    reflected = "sent back a nonce this process issued";
  } else if (peer.name_on_wire == wire::NameOnWire(options.local_name)) {
    reflected = "claims this process's own name";
  }
  if (reflected == nullptr) return absl::OkStatus();
  return WithErrorKind(absl::PermissionDeniedError(absl::StrCat(
      "refused a reflected handshake with ", peer_address, ": the peer ", reflected,
      ", so it is relaying this process's (", options.local_name,
      ") own handshake back to it. Something at that address is not the task it should be; "
      "check who listens there.")),
      ErrorKind::kHandshake);
}

}  // namespace

const char* BuildVersion() { return TF_RDMA_VERSION; }

// After ISO/IEC 9798-4's three-pass mutual authentication with HMAC-SHA-256 (ISO/IEC 9797-2 MAC
// algorithm 2) as the cryptographic check function. Every variable-length field is length-prefixed
// so that no two transcripts encode alike; the nonces, of fixed length, close it. A token
// therefore proves the key to exactly one party, in one role, in one exchange: it cannot be
// replayed (the receiver's own fresh nonce is in it), reflected (the direction is in it) or
// relayed to another party (both names are in it).
wire::Mac HandshakeToken(const std::string& key, TokenDirection direction,
                         const HandshakeTranscript& exchange) {
  const std::string version = absl::StrCat(exchange.protocol_version);
  std::string transcript;
  for (std::string_view field :
       {std::string_view("tf_rdma handshake"),
        std::string_view(direction == TokenDirection::kInitiatorToResponder ? "initiator->responder"
                                                                            : "responder->initiator"),
        std::string_view(version), std::string_view(BackendName(exchange.backend)),
        std::string_view(exchange.initiator_name), std::string_view(exchange.responder_name)}) {
    AppendLengthPrefixed(transcript, field);
  }
  for (const wire::Nonce* nonce : {&exchange.initiator_nonce, &exchange.responder_nonce}) {
    transcript.append(reinterpret_cast<const char*>(nonce->data()), nonce->size());
  }
  return HmacSha256(key, transcript);
}

std::string BuildDescription() {
#ifdef TF_RDMA_BUILT_WITH_TENSORFLOW
  return absl::StrCat(BuildVersion(), ", TensorFlow ", TF_RDMA_BUILT_WITH_TENSORFLOW);
#else
  return BuildVersion();
#endif
}

// The initiator proves first: the responder answers anyone who connects, so a responder proof
// before the initiator's would hand any outsider a token to test guesses of the secret on. The
// initiator's token does go to whoever it dials, so whoever answers at an address it dials (a
// squatter) can test guesses offline: secrets are therefore required to be strong enough that such
// guessing is pointless (config.cc, TF_RDMA_SECRET).
absl::StatusOr<PeerIdentity> ClientHandshake(FrameChannel& channel, Backend backend,
                                             const TransportOptions& options) {
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  absl::StatusOr<std::unique_ptr<OwnNonce>> nonce = OwnNonce::Draw(options.local_name);
  if (!nonce.ok()) return nonce.status();
  const uint32_t version = AnnouncedVersion(options);
  absl::Status sent = channel.Send(
      wire::Frame{wire::FrameType::kHello, OwnGreeting(options, version, backend, (*nonce)->value())});
  if (!sent.ok()) return sent;

  absl::StatusOr<wire::Frame> frame = Expect(channel, wire::FrameType::kChallenge, deadline);
  if (!frame.ok()) return frame.status();
  // A copy: `frame` is reused for the next frame below.
  const wire::Greeting challenge = std::get<wire::Greeting>(frame->body);
  if (challenge.protocol_version != version) {
    return Refuse(channel, VersionMismatch(challenge, channel.PeerAddress(), options));
  }
  absl::Status not_reflected = CheckNotReflected(challenge, channel.PeerAddress(), options);
  if (!not_reflected.ok()) return Refuse(channel, not_reflected);
  const HandshakeTranscript exchange{version, backend, wire::NameOnWire(options.local_name),
                                     challenge.name_on_wire, (*nonce)->value(), challenge.nonce};
  sent = channel.Send(wire::Frame{
      wire::FrameType::kProof,
      wire::Proof{HandshakeToken(options.cluster_key, TokenDirection::kInitiatorToResponder, exchange)}});
  if (!sent.ok()) return sent;
  frame = Expect(channel, wire::FrameType::kAccept, deadline);
  if (!frame.ok()) return frame.status();
  if (!DigestsEqual(HandshakeToken(options.cluster_key, TokenDirection::kResponderToInitiator, exchange),
                    std::get<wire::Accept>(frame->body).mac)) {
    return Refuse(channel, KeyMismatch(challenge.name, channel.PeerAddress()));
  }
  return PeerIdentity{challenge.name, challenge.build};
}

absl::StatusOr<PeerIdentity> ServerHandshake(FrameChannel& channel, Backend backend,
                                             const TransportOptions& options, const AdmitCallback& admit) {
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  absl::StatusOr<wire::Frame> frame = Expect(channel, wire::FrameType::kHello, deadline);
  if (!frame.ok()) return frame.status();
  const auto hello = std::get<wire::Greeting>(frame->body);
  const uint32_t version = AnnouncedVersion(options);
  if (hello.protocol_version != version) {
    return Refuse(channel, VersionMismatch(hello, channel.PeerAddress(), options));
  }
  if (hello.backend != static_cast<uint8_t>(backend)) {
    return Refuse(channel, WithErrorKind(absl::FailedPreconditionError(absl::StrCat(
                                             "backend mismatch: peer ", hello.name, " asked for backend #",
                                             hello.backend, " on a ", BackendName(backend), " listener")),
                                         ErrorKind::kHandshake));
  }
  absl::Status not_reflected = CheckNotReflected(hello, channel.PeerAddress(), options);
  if (!not_reflected.ok()) return Refuse(channel, not_reflected);
  absl::StatusOr<std::unique_ptr<OwnNonce>> nonce = OwnNonce::Draw(options.local_name);
  if (!nonce.ok()) return nonce.status();
  absl::Status sent = channel.Send(
      wire::Frame{wire::FrameType::kChallenge, OwnGreeting(options, version, backend, (*nonce)->value())});
  if (!sent.ok()) return sent;

  frame = Expect(channel, wire::FrameType::kProof, deadline);
  if (!frame.ok()) return frame.status();
  const HandshakeTranscript exchange{version, backend, hello.name_on_wire,
                                     wire::NameOnWire(options.local_name), hello.nonce, (*nonce)->value()};
  if (!DigestsEqual(HandshakeToken(options.cluster_key, TokenDirection::kInitiatorToResponder, exchange),
                    std::get<wire::Proof>(frame->body).mac)) {
    return Refuse(channel, KeyMismatch(hello.name, channel.PeerAddress()));
  }
  // Judged now, by the name the PROOF just proved, so that the initiator learns the verdict as its
  // connect's outcome (and can try again) rather than as a connection closed after it succeeded.
  absl::Status admitted = admit ? admit(hello.name) : absl::OkStatus();
  if (!admitted.ok()) {
    return Refuse(channel, absl::Status(admitted.code(),
                                        absl::StrCat(options.local_name, " does not admit ", hello.name, ": ",
                                                     admitted.message().substr(0, kMaxAdmissionReasonLength))));
  }
  sent = channel.Send(wire::Frame{
      wire::FrameType::kAccept,
      wire::Accept{HandshakeToken(options.cluster_key, TokenDirection::kResponderToInitiator, exchange)}});
  if (!sent.ok()) return sent;
  return PeerIdentity{hello.name, hello.build};
}

bool RefusedForNow(const absl::Status& status) {
  return status.GetPayload(kRefusedForNowPayload).has_value();
}

}  // namespace tf_rdma
