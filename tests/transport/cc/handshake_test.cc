// The handshake as pure code (issue 25): both roles run over in-memory byte pipes framed as the
// stream backends frame them, so that a scripted peer can send what a hostile one would, byte for
// byte. What a token covers, and that reflection, replay and malformed frames get no connection.
#include "cc/transport/handshake.h"

#include <gtest/gtest.h>

#include <cctype>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "cc/transport/connect_retry.h"
#include "cc/transport/crypto.h"
#include "cc/transport/error_kinds.h"

namespace tf_rdma {
namespace {

// One direction of a byte stream. Keeps everything written, for replays.
class Pipe {
 public:
  void Write(std::string_view bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    unread_.append(bytes);
    written_.append(bytes);
    changed_.notify_all();
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    changed_.notify_all();
  }
  absl::StatusOr<std::string> Read(size_t length, absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool ready = changed_.wait_until(lock, absl::ToChronoTime(deadline),
                                           [&] { return unread_.size() >= length || closed_; });
    if (unread_.size() < length) {
      return ready ? absl::UnavailableError("the peer closed the stream")
                   : absl::DeadlineExceededError("the peer sent nothing in time");
    }
    std::string bytes = unread_.substr(0, length);
    unread_.erase(0, length);
    return bytes;
  }
  std::string written() const {
    std::lock_guard<std::mutex> lock(mu_);
    return written_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::string unread_;
  std::string written_;
  bool closed_ = false;
};

// A FrameChannel over two pipes, decoding what arrives as a stream backend does.
class PipeChannel : public FrameChannel {
 public:
  PipeChannel(Pipe& in, Pipe& out) : in_(in), out_(out) {}
  absl::Status Send(const wire::Frame& frame) override {
    sent_.push_back(frame.type);
    out_.Write(wire::Encode(frame));
    return absl::OkStatus();
  }
  absl::StatusOr<wire::Frame> Receive(absl::Time deadline) override {
    absl::StatusOr<std::string> header_bytes = in_.Read(wire::kHeaderLength, deadline);
    if (!header_bytes.ok()) return header_bytes.status();
    absl::StatusOr<wire::Header> header = wire::DecodeHeader(*header_bytes);
    if (!header.ok()) return header.status();
    absl::StatusOr<std::string> body = in_.Read(header->body_length, deadline);
    if (!body.ok()) return body.status();
    return wire::DecodeBody(header->type, *body);
  }
  std::string PeerAddress() const override { return "the test's peer"; }
  // The frame types this side sent, in order.
  const std::vector<wire::FrameType>& sent() const { return sent_; }

 private:
  Pipe& in_;
  Pipe& out_;
  std::vector<wire::FrameType> sent_;
};

// The two directions between an initiator and a responder.
struct Link {
  Pipe to_responder;
  Pipe to_initiator;
  PipeChannel initiator{to_initiator, to_responder};
  PipeChannel responder{to_responder, to_initiator};
};

TransportOptions Options(const std::string& name, const std::string& key = "cluster key") {
  TransportOptions options;
  options.local_name = name;
  options.cluster_key = key;
  options.connect_timeout = absl::Seconds(2);
  return options;
}

std::string Bytes(const wire::Frame& frame) { return wire::Encode(frame); }

// A frame whose header announces `body`'s length, whatever the body holds.
std::string RawFrame(wire::FrameType type, std::string_view body) {
  std::string frame = {static_cast<char>(type), 0, 0, 0};
  const uint32_t length = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) frame.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  return frame.append(body);
}

wire::Nonce NonceOf(uint8_t fill) {
  wire::Nonce nonce;
  nonce.fill(fill);
  return nonce;
}

wire::Greeting GreetingOf(const std::string& name, const wire::Nonce& nonce) {
  wire::Greeting greeting;
  greeting.backend = static_cast<uint8_t>(Backend::kTcp);
  greeting.nonce = nonce;
  greeting.name = name;
  greeting.build = "test";
  return greeting;
}

// Runs `side` on a thread of its own, closing its outgoing pipe when it returns (as a backend
// closes the socket), so that the other side never waits for it beyond that.
class Running {
 public:
  Running(std::function<absl::StatusOr<PeerIdentity>()> side, Pipe& out)
      : thread_([this, side = std::move(side), &out] {
          result_ = side();
          out.Close();
        }) {}
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;
  // A test that stopped early still waits for the side, which its deadline bounds.
  ~Running() {
    if (thread_.joinable()) thread_.join();
  }
  absl::StatusOr<PeerIdentity> Result() {
    thread_.join();
    return result_;
  }

 private:
  absl::StatusOr<PeerIdentity> result_ = absl::UnknownError("not run");
  std::thread thread_;
};

Running Initiator(Link& link, const TransportOptions& options) {
  return Running([&link, options] { return ClientHandshake(link.initiator, Backend::kTcp, options); },
                 link.to_responder);
}

Running Responder(Link& link, const TransportOptions& options, AdmitCallback admit = nullptr) {
  return Running([&link, options, admit] { return ServerHandshake(link.responder, Backend::kTcp, options, admit); },
                 link.to_initiator);
}

class Handshake : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status crypto = LoadCrypto();
    ASSERT_TRUE(crypto.ok()) << crypto;
  }
};

TEST_F(Handshake, PeersHoldingTheSameKeyLearnEachOthersNames) {
  Link link;
  Running responder = Responder(link, Options("ps"));
  Running initiator = Initiator(link, Options("worker"));
  absl::StatusOr<PeerIdentity> at_initiator = initiator.Result();
  absl::StatusOr<PeerIdentity> at_responder = responder.Result();
  ASSERT_TRUE(at_initiator.ok()) << at_initiator.status();
  ASSERT_TRUE(at_responder.ok()) << at_responder.status();
  EXPECT_EQ(at_initiator->name, "ps");
  EXPECT_EQ(at_responder->name, "worker");
}

TEST_F(Handshake, AnInitiatorWithAnotherKeyIsRefusedAndLearnsNothingOfTheKey) {
  Link link;
  Running responder = Responder(link, Options("ps"));
  Running initiator = Initiator(link, Options("worker", "another key"));
  const absl::Status at_responder = responder.Result().status();
  EXPECT_EQ(at_responder.code(), absl::StatusCode::kPermissionDenied) << at_responder;
  EXPECT_NE(at_responder.message().find("cluster key mismatch with worker"), std::string::npos) << at_responder;
  EXPECT_EQ(ErrorKindOf(at_responder), "handshake") << at_responder;
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_FALSE(at_initiator.ok());
  EXPECT_EQ(ErrorKindOf(at_initiator), "handshake") << at_initiator;  // the REJECT: refused for good
  EXPECT_EQ(link.responder.sent(), (std::vector{wire::FrameType::kChallenge, wire::FrameType::kReject}));
}

// The listener's admission: judged once the PROOF checked out, by the proven name, and
// its refusal sent in place of the ACCEPT, so that the initiator's connect fails with its code.
TEST_F(Handshake, AResponderNotAdmittingTheInitiatorNowRefusesInPlaceOfTheAcceptAndItMayRetry) {
  Link link;
  std::vector<std::string> judged;
  Running responder = Responder(link, Options("ps"), [&judged](const std::string& peer) {
    judged.push_back(peer);
    return absl::UnavailableError("its old connection is alive still");
  });
  Running initiator = Initiator(link, Options("worker"));
  const absl::Status at_initiator = initiator.Result().status();
  const absl::Status at_responder = responder.Result().status();
  EXPECT_EQ(judged, std::vector<std::string>{"worker"});
  EXPECT_EQ(at_initiator.code(), absl::StatusCode::kUnavailable) << at_initiator;
  EXPECT_NE(at_initiator.message().find("ps does not admit worker: its old connection is alive still"),
            std::string::npos)
      << at_initiator;
  EXPECT_TRUE(RefusedForNow(at_initiator)) << at_initiator;
  EXPECT_EQ(ErrorKindOf(at_initiator), std::nullopt) << at_initiator;  // an unreachable peer, if it lasts
  EXPECT_EQ(at_responder.code(), absl::StatusCode::kUnavailable) << at_responder;
  EXPECT_EQ(link.responder.sent(), (std::vector{wire::FrameType::kChallenge, wire::FrameType::kReject}));
}

TEST_F(Handshake, AnInitiatorTheResponderNeverAdmitsIsRefusedForGood) {
  Link link;
  Running responder = Responder(link, Options("ps"), [](const std::string&) {
    return absl::PermissionDeniedError("not the side that connects");
  });
  Running initiator = Initiator(link, Options("worker"));
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_EQ(at_initiator.code(), absl::StatusCode::kPermissionDenied) << at_initiator;
  EXPECT_NE(at_initiator.message().find("ps does not admit worker: not the side that connects"), std::string::npos)
      << at_initiator;
  EXPECT_FALSE(RefusedForNow(at_initiator)) << at_initiator;
  EXPECT_EQ(ErrorKindOf(at_initiator), "handshake") << at_initiator;
  EXPECT_FALSE(responder.Result().ok());
}

TEST_F(Handshake, TheAdmissionJudgesOnlyInitiatorsThatProvedTheKey) {
  Link link;
  bool judged = false;
  Running responder = Responder(link, Options("ps"), [&judged](const std::string&) {
    judged = true;
    return absl::OkStatus();
  });
  Running initiator = Initiator(link, Options("worker", "another key"));
  EXPECT_EQ(responder.Result().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(initiator.Result().ok());
  EXPECT_FALSE(judged);
}

TEST_F(Handshake, AResponderThatHangsUpInPlaceOfTheAcceptIsNoRefusalForNow) {
  // kUnavailable as well, but the connection ended: not the listener's "not now".
  Link link;
  Running initiator = Initiator(link, Options("worker"));
  PipeChannel& responder = link.responder;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  ASSERT_TRUE(responder.Receive(deadline).ok());
  ASSERT_TRUE(responder.Send(wire::Frame{wire::FrameType::kChallenge, GreetingOf("ps", NonceOf(11))}).ok());
  ASSERT_TRUE(responder.Receive(deadline).ok());
  link.to_initiator.Close();
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_EQ(at_initiator.code(), absl::StatusCode::kUnavailable) << at_initiator;
  EXPECT_FALSE(RefusedForNow(at_initiator)) << at_initiator;
  EXPECT_EQ(ErrorKindOf(at_initiator), std::nullopt) << at_initiator;  // a lost peer, not a refusal
}

// A dial the listener kept refusing "not now" and whose last attempt then ran out of time some
// other way (rdma_cm under emulation) gives up naming the refusal, the true cause, and not asking
// whether the peer runs tf_rdma at all.
TEST_F(Handshake, ADialThatGivesUpAfterRefusalsNamesTheRefusalWhateverItsLastAttemptMet) {
  Link link;
  Running responder = Responder(link, Options("ps"), [](const std::string&) {
    return absl::UnavailableError("its old connection is alive still");
  });
  Running initiator = Initiator(link, Options("worker"));
  const absl::Status refused = initiator.Result().status();
  ASSERT_TRUE(RefusedForNow(refused)) << refused;
  int attempts = 0;
  const absl::Status gave_up =
      ConnectWithRetries(Backend::kVerbs, Endpoint{"10.0.0.1", 7}, absl::Milliseconds(50),
                         [&](absl::Time) {
                           ++attempts;
                           if (attempts == 1) return ConnectAttempt{refused, true};
                           return ConnectAttempt{absl::UnavailableError("rdma_cm: no answer in time"), true};
                         })
          .status();
  EXPECT_GE(attempts, 2);
  EXPECT_EQ(gave_up.code(), absl::StatusCode::kUnavailable) << gave_up;
  EXPECT_NE(gave_up.message().find("TF_RDMA_CONNECT_TIMEOUT_MS"), std::string::npos) << gave_up;
  EXPECT_NE(gave_up.message().find("ps does not admit worker: its old connection is alive still"), std::string::npos)
      << gave_up;
  EXPECT_EQ(gave_up.message().find("Is the peer running"), std::string::npos) << gave_up;
}

class HandshakeTokenTest : public Handshake {
 protected:
  HandshakeTranscript Base() const {
    return HandshakeTranscript{wire::kProtocolVersion, Backend::kTcp, "worker", "ps", NonceOf(1), NonceOf(2)};
  }
  wire::Mac Token(const HandshakeTranscript& exchange,
                  TokenDirection direction = TokenDirection::kInitiatorToResponder,
                  const std::string& key = "cluster key") const {
    return HandshakeToken(key, direction, exchange);
  }
};

TEST_F(HandshakeTokenTest, CoversTheKeyDirectionVersionBackendBothNamesAndBothNonces) {
  const wire::Mac base = Token(Base());
  EXPECT_EQ(Token(Base()), base);
  std::vector<std::pair<const char*, wire::Mac>> variations;
  variations.emplace_back("key", Token(Base(), TokenDirection::kInitiatorToResponder, "other key"));
  variations.emplace_back("direction", Token(Base(), TokenDirection::kResponderToInitiator));
  auto varied = [&](const char* what, std::function<void(HandshakeTranscript&)> change) {
    HandshakeTranscript exchange = Base();
    change(exchange);
    variations.emplace_back(what, Token(exchange));
  };
  varied("version", [](HandshakeTranscript& e) { e.protocol_version += 1; });
  varied("backend", [](HandshakeTranscript& e) { e.backend = Backend::kShm; });
  varied("initiator name", [](HandshakeTranscript& e) { e.initiator_name = "worker2"; });
  varied("responder name", [](HandshakeTranscript& e) { e.responder_name = "ps2"; });
  varied("names swapped", [](HandshakeTranscript& e) { std::swap(e.initiator_name, e.responder_name); });
  varied("initiator nonce", [](HandshakeTranscript& e) { e.initiator_nonce[31] ^= 1; });
  varied("responder nonce", [](HandshakeTranscript& e) { e.responder_nonce[0] ^= 1; });
  varied("nonces swapped", [](HandshakeTranscript& e) { std::swap(e.initiator_nonce, e.responder_nonce); });
  for (const auto& [what, token] : variations) EXPECT_NE(token, base) << "the token does not cover the " << what;
}

TEST_F(HandshakeTokenTest, NamesAreFramedSoThatMovingBytesBetweenThemChangesTheToken) {
  HandshakeTranscript joined = Base();
  joined.initiator_name = "ab";
  joined.responder_name = "c";
  HandshakeTranscript moved = joined;
  moved.initiator_name = "a";
  moved.responder_name = "bc";
  EXPECT_NE(Token(joined), Token(moved));
}

TEST_F(Handshake, AResponderRefusesItsOwnHandshakeRelayedBackToIt) {
  // A relay that connects a task's dial to the same task's listener: the listener sees a HELLO
  // carrying a nonce the task has in flight, and refuses before it sends anything that depends
  // on the key; the initiator never sends its proof.
  Link link;
  Running initiator = Initiator(link, Options("worker"));
  Running responder = Responder(link, Options("worker"));
  const absl::Status at_responder = responder.Result().status();
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_EQ(at_responder.code(), absl::StatusCode::kPermissionDenied) << at_responder;
  EXPECT_NE(at_responder.message().find("refused a reflected handshake"), std::string::npos) << at_responder;
  EXPECT_NE(at_responder.message().find("sent back a nonce this process issued"), std::string::npos)
      << at_responder;
  EXPECT_NE(at_initiator.message().find("refused a reflected handshake"), std::string::npos) << at_initiator;
  EXPECT_EQ(link.initiator.sent(), std::vector{wire::FrameType::kHello});
  EXPECT_EQ(link.responder.sent(), std::vector{wire::FrameType::kReject});
}

TEST_F(Handshake, AnInitiatorSendsNoProofToAResponderEchoingItsNonce) {
  Link link;
  Running initiator = Initiator(link, Options("worker"));
  PipeChannel& responder = link.responder;
  absl::StatusOr<wire::Frame> hello = responder.Receive(absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(hello.ok()) << hello.status();
  ASSERT_TRUE(responder.Send(wire::Frame{wire::FrameType::kChallenge,
                                         GreetingOf("ps", std::get<wire::Greeting>(hello->body).nonce)}).ok());
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_EQ(at_initiator.code(), absl::StatusCode::kPermissionDenied) << at_initiator;
  EXPECT_NE(at_initiator.message().find("sent back a nonce this process issued"), std::string::npos)
      << at_initiator;
  EXPECT_EQ(link.initiator.sent(), (std::vector{wire::FrameType::kHello, wire::FrameType::kReject}));
}

TEST_F(Handshake, APeerClaimingTheProcesssOwnNameIsRefusedInEitherRole) {
  Link to_responder;
  Running responder = Responder(to_responder, Options("ps"));
  ASSERT_TRUE(to_responder.initiator.Send(wire::Frame{wire::FrameType::kHello, GreetingOf("ps", NonceOf(7))}).ok());
  const absl::Status at_responder = responder.Result().status();
  EXPECT_NE(at_responder.message().find("claims this process's own name"), std::string::npos) << at_responder;

  Link to_initiator;
  Running initiator = Initiator(to_initiator, Options("worker"));
  ASSERT_TRUE(to_initiator.responder.Receive(absl::Now() + absl::Seconds(2)).ok());
  ASSERT_TRUE(
      to_initiator.responder.Send(wire::Frame{wire::FrameType::kChallenge, GreetingOf("worker", NonceOf(8))}).ok());
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_NE(at_initiator.message().find("claims this process's own name"), std::string::npos) << at_initiator;
  EXPECT_EQ(to_initiator.initiator.sent(), (std::vector{wire::FrameType::kHello, wire::FrameType::kReject}));
}

TEST_F(Handshake, AnInitiatorsProofReflectedBackAsTheAcceptIsRefused) {
  Link link;
  Running initiator = Initiator(link, Options("worker"));
  PipeChannel& responder = link.responder;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  ASSERT_TRUE(responder.Receive(deadline).ok());
  ASSERT_TRUE(responder.Send(wire::Frame{wire::FrameType::kChallenge, GreetingOf("ps", NonceOf(9))}).ok());
  absl::StatusOr<wire::Frame> proof = responder.Receive(deadline);
  ASSERT_TRUE(proof.ok()) << proof.status();
  ASSERT_TRUE(responder.Send(wire::Frame{wire::FrameType::kAccept,
                                         wire::Accept{std::get<wire::Proof>(proof->body).mac}}).ok());
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_EQ(at_initiator.code(), absl::StatusCode::kPermissionDenied) << at_initiator;
  EXPECT_NE(at_initiator.message().find("cluster key mismatch with ps"), std::string::npos) << at_initiator;
}

TEST_F(Handshake, WhatEitherSideSentInOneExchangeIsRefusedWhenReplayedInTheNext) {
  Link recorded;
  Running responder = Responder(recorded, Options("ps"));
  Running initiator = Initiator(recorded, Options("worker"));
  ASSERT_TRUE(initiator.Result().ok());
  ASSERT_TRUE(responder.Result().ok());

  // The initiator's HELLO and PROOF, replayed to the responder: its fresh nonce is not in the proof.
  Link replay_to_responder;
  Running replayed_responder = Responder(replay_to_responder, Options("ps"));
  replay_to_responder.to_responder.Write(recorded.to_responder.written());
  const absl::Status at_responder = replayed_responder.Result().status();
  EXPECT_NE(at_responder.message().find("cluster key mismatch with worker"), std::string::npos) << at_responder;
  EXPECT_EQ(replay_to_responder.responder.sent(),
            (std::vector{wire::FrameType::kChallenge, wire::FrameType::kReject}));

  // The responder's CHALLENGE and ACCEPT, replayed to the initiator: its fresh nonce is not in the accept.
  Link replay_to_initiator;
  Running replayed_initiator = Initiator(replay_to_initiator, Options("worker"));
  replay_to_initiator.to_initiator.Write(recorded.to_initiator.written());
  const absl::Status at_initiator = replayed_initiator.Result().status();
  EXPECT_NE(at_initiator.message().find("cluster key mismatch with ps"), std::string::npos) << at_initiator;
}

struct Malformed {
  const char* what;
  std::function<std::string()> bytes;  // what the initiator sends
};

class HandshakeMalformed : public Handshake, public ::testing::WithParamInterface<Malformed> {};

// The responder must refuse each with kDataLoss and send nothing that depends on the key.
TEST_P(HandshakeMalformed, EndsTheHandshakeAsDataLoss) {
  Link link;
  Running responder = Responder(link, Options("ps"));
  link.to_responder.Write(GetParam().bytes());
  const absl::Status at_responder = responder.Result().status();
  EXPECT_EQ(at_responder.code(), absl::StatusCode::kDataLoss) << at_responder;
  for (wire::FrameType sent : link.responder.sent()) EXPECT_NE(sent, wire::FrameType::kAccept);
}

std::string Hello() { return Bytes(wire::Frame{wire::FrameType::kHello, GreetingOf("worker", NonceOf(3))}); }

std::string HelloBody() { return Hello().substr(wire::kHeaderLength); }

INSTANTIATE_TEST_SUITE_P(
    Lengths, HandshakeMalformed,
    ::testing::Values(
        Malformed{"a PROOF one byte short", [] { return Hello() + RawFrame(wire::FrameType::kProof, std::string(31, 'p')); }},
        Malformed{"a PROOF one byte long", [] { return Hello() + RawFrame(wire::FrameType::kProof, std::string(33, 'p')); }},
        Malformed{"an empty PROOF", [] { return Hello() + RawFrame(wire::FrameType::kProof, ""); }},
        Malformed{"a HELLO cut inside its nonce",
                  [] { return RawFrame(wire::FrameType::kHello, HelloBody().substr(0, 20)); }},
        Malformed{"a HELLO whose name runs past its end",
                  [] {
                    std::string body = HelloBody();
                    body[37] = static_cast<char>(0xff);  // the name's u16 length, after version, backend, nonce
                    return RawFrame(wire::FrameType::kHello, body);
                  }},
        Malformed{"a HELLO with trailing bytes", [] { return RawFrame(wire::FrameType::kHello, HelloBody() + "xx"); }},
        Malformed{"a HELLO longer than any frame may be",
                  [] { return RawFrame(wire::FrameType::kHello, std::string(wire::kMaxBodyLength + 1, 'x')); }}),
    [](const ::testing::TestParamInfo<Malformed>& info) {
      std::string name;
      for (const char* c = info.param.what; *c; ++c) name += std::isalnum(static_cast<unsigned char>(*c)) ? *c : '_';
      return name;
    });

TEST_F(Handshake, AnInitiatorRefusesAChallengeCutShort) {
  Link link;
  Running initiator = Initiator(link, Options("worker"));
  ASSERT_TRUE(link.responder.Receive(absl::Now() + absl::Seconds(2)).ok());
  const std::string challenge =
      Bytes(wire::Frame{wire::FrameType::kChallenge, GreetingOf("ps", NonceOf(4))}).substr(wire::kHeaderLength);
  link.to_initiator.Write(RawFrame(wire::FrameType::kChallenge, challenge.substr(0, challenge.size() - 1)));
  const absl::Status at_initiator = initiator.Result().status();
  EXPECT_EQ(at_initiator.code(), absl::StatusCode::kDataLoss) << at_initiator;
  EXPECT_EQ(link.initiator.sent(), std::vector{wire::FrameType::kHello});
}

TEST_F(Handshake, APeerThatStaysSilentFailsTheHandshakeAtItsDeadline) {
  Link link;
  TransportOptions options = Options("ps");
  options.connect_timeout = absl::Milliseconds(100);
  const absl::Time started = absl::Now();
  Running responder = Responder(link, options);
  const absl::Status at_responder = responder.Result().status();
  EXPECT_EQ(at_responder.code(), absl::StatusCode::kDeadlineExceeded) << at_responder;
  EXPECT_LT(absl::Now() - started, absl::Seconds(2));
}

}  // namespace
}  // namespace tf_rdma
