#include "cc/transport/handshake.h"

#include <sys/random.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cc/transport/hmac.h"

#ifndef TF_RDMA_VERSION
#define TF_RDMA_VERSION "dev"
#endif

namespace tf_rdma {
namespace {

absl::StatusOr<wire::Nonce> FreshNonce() {
  wire::Nonce nonce;
  size_t filled = 0;
  while (filled < nonce.size()) {
    const ssize_t n = getrandom(nonce.data() + filled, nonce.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom failed: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  return nonce;
}

// Binds the proof to both nonces, the role and the backend, so a proof cannot be replayed on
// another connection or reflected back to its sender.
wire::Mac Prove(const std::string& key, const char* role, const wire::Nonce& first,
                const wire::Nonce& second, Backend backend) {
  std::string message = absl::StrCat("tf_rdma-handshake/", role, "/", BackendName(backend), "/");
  message.append(reinterpret_cast<const char*>(first.data()), first.size());
  message.append(reinterpret_cast<const char*>(second.data()), second.size());
  return HmacSha256(key, message);
}

uint32_t AnnouncedVersion(const TransportOptions& options) {
  return options.protocol_version_override ? options.protocol_version_override
                                           : wire::kProtocolVersion;
}

absl::Status Refuse(FrameChannel& channel, absl::Status status) {
  wire::Reject reject{static_cast<uint32_t>(status.code()), std::string(status.message())};
  channel.Send(wire::Frame{wire::FrameType::kReject, reject}).IgnoreError();
  return status;
}

absl::Status VersionMismatch(const wire::Greeting& peer, const std::string& peer_address,
                             const TransportOptions& options) {
  return absl::FailedPreconditionError(absl::StrCat(
      "tf_rdma version mismatch with peer ", peer.name, " at ", peer_address,
      ": it speaks wire protocol ", peer.protocol_version, " (tf_rdma ", peer.build,
      "), this process (", options.local_name, ") speaks ", AnnouncedVersion(options), " (tf_rdma ",
      BuildVersion(), "). Install the same tf_rdma version in every task of the cluster."));
}

absl::Status KeyMismatch(const std::string& who, const std::string& peer_address) {
  return absl::PermissionDeniedError(absl::StrCat(
      "cluster key mismatch with ", who, " at ", peer_address,
      ": the peer does not belong to this cluster. Start every task with the same cluster spec "
      "and the same TF_RDMA_SECRET."));
}

// Expects a frame of `type`; a REJECT becomes the peer's error, anything else a protocol error.
absl::StatusOr<wire::Frame> Expect(FrameChannel& channel, wire::FrameType type, absl::Time deadline) {
  absl::StatusOr<wire::Frame> frame = channel.Receive(deadline);
  if (!frame.ok()) {
    return absl::Status(frame.status().code(),
                        absl::StrCat("handshake with ", channel.PeerAddress(), " failed: ",
                                     frame.status().message()));
  }
  if (frame->type == wire::FrameType::kReject) {
    const auto& reject = std::get<wire::Reject>(frame->body);
    const auto code = reject.code > 0 && reject.code <= 16 ? static_cast<absl::StatusCode>(reject.code)
                                                           : absl::StatusCode::kUnknown;
    return absl::Status(code, absl::StrCat("peer at ", channel.PeerAddress(),
                                           " refused the connection: ", reject.message));
  }
  if (frame->type != type) {
    return absl::DataLossError(absl::StrCat("handshake with ", channel.PeerAddress(), ": expected ",
                                            wire::FrameTypeName(type), ", got ",
                                            wire::FrameTypeName(frame->type)));
  }
  return frame;
}

}  // namespace

const char* BuildVersion() { return TF_RDMA_VERSION; }

// The client proves first: a listener answers anyone who connects, so anything it sent that
// depends on the key before the client proved it would let one unauthenticated exchange test
// guesses of the secret offline. The listener's proof comes in its ACCEPT.
absl::StatusOr<PeerIdentity> ClientHandshake(FrameChannel& channel, Backend backend,
                                             const TransportOptions& options) {
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  absl::StatusOr<wire::Nonce> nonce = FreshNonce();
  if (!nonce.ok()) return nonce.status();
  wire::Greeting hello;
  hello.protocol_version = AnnouncedVersion(options);
  hello.backend = static_cast<uint8_t>(backend);
  hello.nonce = *nonce;
  hello.name = options.local_name;
  hello.build = BuildVersion();
  absl::Status sent = channel.Send(wire::Frame{wire::FrameType::kHello, hello});
  if (!sent.ok()) return sent;

  absl::StatusOr<wire::Frame> frame = Expect(channel, wire::FrameType::kChallenge, deadline);
  if (!frame.ok()) return frame.status();
  // A copy: `frame` is reused for the next frame below.
  const wire::Greeting challenge = std::get<wire::Greeting>(frame->body);
  if (challenge.protocol_version != AnnouncedVersion(options)) {
    return Refuse(channel, VersionMismatch(challenge, channel.PeerAddress(), options));
  }
  wire::Proof proof{Prove(options.cluster_key, "client", challenge.nonce, hello.nonce, backend)};
  sent = channel.Send(wire::Frame{wire::FrameType::kProof, proof});
  if (!sent.ok()) return sent;
  frame = Expect(channel, wire::FrameType::kAccept, deadline);
  if (!frame.ok()) return frame.status();
  const wire::Mac expected = Prove(options.cluster_key, "server", hello.nonce, challenge.nonce, backend);
  if (!DigestsEqual(expected, std::get<wire::Accept>(frame->body).mac)) {
    return Refuse(channel, KeyMismatch(challenge.name, channel.PeerAddress()));
  }
  return PeerIdentity{challenge.name, challenge.build};
}

absl::StatusOr<PeerIdentity> ServerHandshake(FrameChannel& channel, Backend backend,
                                             const TransportOptions& options) {
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  absl::StatusOr<wire::Frame> frame = Expect(channel, wire::FrameType::kHello, deadline);
  if (!frame.ok()) return frame.status();
  const auto hello = std::get<wire::Greeting>(frame->body);
  if (hello.protocol_version != AnnouncedVersion(options)) {
    return Refuse(channel, VersionMismatch(hello, channel.PeerAddress(), options));
  }
  if (hello.backend != static_cast<uint8_t>(backend)) {
    return Refuse(channel, absl::FailedPreconditionError(absl::StrCat(
                               "backend mismatch: peer ", hello.name, " asked for backend #",
                               hello.backend, " on a ", BackendName(backend), " listener")));
  }
  absl::StatusOr<wire::Nonce> nonce = FreshNonce();
  if (!nonce.ok()) return nonce.status();
  wire::Greeting challenge;
  challenge.protocol_version = AnnouncedVersion(options);
  challenge.backend = hello.backend;
  challenge.nonce = *nonce;
  challenge.name = options.local_name;
  challenge.build = BuildVersion();
  absl::Status sent = channel.Send(wire::Frame{wire::FrameType::kChallenge, challenge});
  if (!sent.ok()) return sent;

  frame = Expect(channel, wire::FrameType::kProof, deadline);
  if (!frame.ok()) return frame.status();
  const wire::Mac expected = Prove(options.cluster_key, "client", challenge.nonce, hello.nonce, backend);
  if (!DigestsEqual(expected, std::get<wire::Proof>(frame->body).mac)) {
    return Refuse(channel, KeyMismatch(hello.name, channel.PeerAddress()));
  }
  wire::Accept accept{Prove(options.cluster_key, "server", hello.nonce, challenge.nonce, backend)};
  sent = channel.Send(wire::Frame{wire::FrameType::kAccept, accept});
  if (!sent.ok()) return sent;
  return PeerIdentity{hello.name, hello.build};
}

}  // namespace tf_rdma
