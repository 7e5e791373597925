// Connection setup shared by every backend: both peers prove they hold the same cluster key and
// speak the same wire protocol. ISO/IEC 9798-4 three-pass mutual authentication with HMAC-SHA-256:
//   initiator -> HELLO     {version, backend, initiator nonce Ni, initiator name I}
//   responder -> CHALLENGE {version, backend, responder nonce Nr, responder name R}
//   initiator -> PROOF     HMAC(key, "initiator->responder", version, backend, I, R, Ni, Nr)
//   responder -> ACCEPT    HMAC(key, "responder->initiator", version, backend, I, R, Ni, Nr)
// The key never travels. Either side refuses a peer that uses its own name or one of the nonces
// this process has in flight (a relay of its own handshake back to it). A responder whose listener
// does not admit the initiator (AdmitCallback, judged by the name the PROOF proved) sends a REJECT
// in place of the ACCEPT, with the listener's code: kUnavailable asks the initiator to try again.
// No REJECT is authenticated: the initiator quotes its text as the unverified words of whoever
// answered, and tries again only where a legitimate listener asks it to (RefusedForNow).
#ifndef TF_RDMA_CC_TRANSPORT_HANDSHAKE_H_
#define TF_RDMA_CC_TRANSPORT_HANDSHAKE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/transport/transport.h"
#include "cc/transport/wire.h"

namespace tf_rdma {

// The blocking, framed channel a backend offers for the handshake.
class FrameChannel {
 public:
  virtual ~FrameChannel() = default;
  virtual absl::Status Send(const wire::Frame& frame) = 0;
  virtual absl::StatusOr<wire::Frame> Receive(absl::Time deadline) = 0;
  // How the peer is reached, for error messages ("127.0.0.1:5000").
  virtual std::string PeerAddress() const = 0;
};

struct PeerIdentity {
  std::string name;
  std::string build;
};

// The version string of this tf_rdma build.
const char* BuildVersion();
// What peers are told of this build (so mismatches and `tf_rdma doctor` can name both sides): its
// version and the TensorFlow it was built against, e.g. "0.1.0, TensorFlow 2.21.0".
std::string BuildDescription();

// The two tokens of one handshake: the initiator's PROOF and the responder's ACCEPT.
enum class TokenDirection { kInitiatorToResponder, kResponderToInitiator };
// What a token covers besides the key and its direction. Names are the bytes that travelled
// (wire::Greeting::name_on_wire; one's own: wire::NameOnWire).
struct HandshakeTranscript {
  uint32_t protocol_version;
  Backend backend;
  std::string initiator_name;
  std::string responder_name;
  wire::Nonce initiator_nonce;
  wire::Nonce responder_nonce;
};

// CreateTransport has loaded libcrypto (LoadCrypto) before any of these runs.
wire::Mac HandshakeToken(const std::string& key, TokenDirection direction,
                         const HandshakeTranscript& exchange);
absl::StatusOr<PeerIdentity> ClientHandshake(FrameChannel& channel, Backend backend,
                                             const TransportOptions& options);
// `admit` (may be empty: everyone) judges the initiator once its PROOF checked out.
absl::StatusOr<PeerIdentity> ServerHandshake(FrameChannel& channel, Backend backend,
                                             const TransportOptions& options,
                                             const AdmitCallback& admit = nullptr);
// Whether a ClientHandshake failed because the listener refused this process for now (no
// handshake slot free, or its admission answered kUnavailable): another attempt, after a backoff,
// may be admitted. Unauthenticated, as every REJECT is: a squatter may say it too.
bool RefusedForNow(const absl::Status& status);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_HANDSHAKE_H_
