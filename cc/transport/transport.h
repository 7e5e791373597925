// The transport layer: receiver-granted, one-sided writes between two processes.
//
// The model is RDMA's, whatever the backend underneath:
//   * A receiver owns MemoryRegions. It grants a byte range of one of them to a peer for one tagged
//     message (Connection::Grant). Only granted ranges are ever written, and a range is the receiver's
//     again once the grant completes (data landed, grant revoked, or connection failed).
//   * A sender writes a byte range of its own memory to the peer under a tag (Connection::Write). The
//     write waits until the peer's grant for that tag arrives, then places the bytes straight into the
//     granted range, and both sides are told: the sender that its memory may be reused, the receiver
//     how many bytes landed.
//   * A message larger than the grant is not written: the receiver's grant completes with
//     kResourceExhausted and the size needed, and the receiver may grant a bigger range for the same
//     tag; the sender's write keeps waiting for it.
// Grants and writes with the same tag pair in FIFO order. Nothing here depends on TensorFlow.
#ifndef TF_RDMA_CC_TRANSPORT_TRANSPORT_H_
#define TF_RDMA_CC_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/transport/settings.h"

namespace tf_rdma {

// A backend is its folder (tcp/, shm/, verbs/), its enumerator and name here and in backend_names.cc,
// and its registration (backend_registry.cc), which says where it works and creates it.
enum class Backend { kTcp, kShm, kVerbs };
const char* BackendName(Backend backend);
// Every backend's name, ", "-separated, for messages that list the choices.
std::string BackendNames();
absl::StatusOr<Backend> ParseBackend(const std::string& name);

// Identifies one message between two peers; both sides must derive the same value.
struct Tag {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const Tag& other) const { return hi == other.hi && lo == other.lo; }
};

struct TagHash {
  size_t operator()(const Tag& tag) const { return tag.hi * 0x9e3779b97f4a7c15ULL ^ tag.lo; }
};

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;
  // Accepts "host:port" and "[v6addr]:port".
  static absl::StatusOr<Endpoint> Parse(const std::string& text);
};

// Memory that peers may write into once granted. Backends place it where their writes can reach it
// (plain pages for tcp, a shared memory file for shm, a registered MR for verbs).
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  uint32_t id() const { return id_; }
  char* data() const { return data_; }
  size_t size() const { return size_; }

 protected:
  MemoryRegion(uint32_t id, char* data, size_t size) : id_(id), data_(data), size_(size) {}

 private:
  const uint32_t id_;
  char* const data_;
  const size_t size_;
};

// Outcome of a grant, delivered once. status is OK with `length` bytes written at the granted
// offset; kResourceExhausted when the sender's message needs `length` bytes, more than granted;
// kCancelled after Revoke; kAborted when the sender withdrew the message (Withdraw), saying why;
// otherwise the connection's error.
struct GrantResult {
  absl::Status status;
  uint64_t length = 0;
};
using GrantDone = std::function<void(const GrantResult&)>;
using WriteDone = std::function<void(const absl::Status&)>;

// Which thread runs a callback. Every backend serves all connections of a transport from a few I/O
// threads (TransportOptions::io_threads), "the transport's threads". Callbacks run once, never with a lock of the transport held, and
// must not block: the thread that runs one serves other peers' connections too.
//   * GrantDone runs on a transport thread when the peer's DATA, TOO_SMALL, REVOKED or WITHDRAWN frame
//     arrives or the peer is found silent (TransportOptions::peer_timeout). It runs on the
//     caller's thread inside Grant only when the grant is refused at once (a bad range, or the
//     connection failed already), and inside Close (on whichever thread closes) for grants that
//     were still out. Never inside Revoke, DiscardPeerWrites, Write or Withdraw.
//   * WriteDone runs inside Write when the write completes at once: its message went onto the
//     socket whole (tcp and shm send small messages from the caller's thread; this saves a thread
//     hand-off per message), its tag was discarded or withdrawn, or the connection failed. On the
//     transport thread that is handling the same connection's events (inside one of its
//     callbacks), tcp and shm send nothing before that handling returns: then what it queued
//     leaves in one send, and WriteDone runs on that thread, after Write returned. It runs
//     inside Grant/Revoke/DiscardPeerWrites/Withdraw/Close of the same connection when that call
//     completes it (a paired write sent from there, a dropped one, a close), and else on a transport thread
//     (the peer's grant arrived, the socket drained).

class Connection {
 public:
  virtual ~Connection() = default;

  // Receiver side. Returns the grant's id (for Revoke). `done` may run on a transport thread, before
  // Grant returns if the connection has already failed; it must not block.
  virtual uint64_t Grant(const Tag& tag, std::shared_ptr<MemoryRegion> region, uint64_t offset,
                         uint64_t capacity, GrantDone done) = 0;
  // Takes a grant back. Its `done` runs with kCancelled once the peer confirmed it will not write,
  // or with OK if the data won the race. Either way the range is free after `done` ran.
  virtual void Revoke(uint64_t grant_id) = 0;
  // Tells the sender (a DISCARD frame) that no message under `tag` is wanted any more (the
  // receiver's step was cancelled): it drops its writes waiting under the tag, and any that come
  // later, which complete with kCancelled instead of holding their memory until the connection
  // closes. Grants under the tag are not affected (revoke them first). Senders remember the most
  // recent discarded tags (grant_book.h).
  virtual void DiscardPeerWrites(const Tag& tag) = 0;

  // Sender side. [src, src + length) must stay valid and unchanged until `done` runs.
  virtual void Write(const Tag& tag, const void* src, uint64_t length, WriteDone done) = 0;
  // The sender withdraws `tag` for `why` (its step was aborted, or ended) and drops its writes
  // under it: those still waiting for a grant, and any that come later, complete with
  // DiscardedWrite(), as after the receiver's DiscardPeerWrites. A receiver tells only about
  // receives it issued; one whose step ended before it issued a receive never will, and the write
  // would hold its memory until the connection closes. The receiver's grants under the tag, unused
  // now or made later, are answered with a WITHDRAWN frame: their GrantDone gets kAborted with
  // `why`'s code and message and this process's name, where it would otherwise wait for a message
  // that never comes. A write already paired with a grant goes on. Remembered apart from
  // discarded tags, as many (grant_book.h).
  virtual void Withdraw(const Tag& tag, const absl::Status& why) = 0;

  // Fails every pending and future operation with `reason` and tells the peer why.
  virtual void Close(const absl::Status& reason) = 0;
  // OK while the connection is usable, else the error that ended it.
  virtual absl::Status health() const = 0;
  virtual const std::string& peer_name() const = 0;
  // The peer's tf_rdma build and the TensorFlow it was built against, as its handshake stated them
  // (for diagnostics: python -m tf_rdma doctor).
  virtual const std::string& peer_build() const = 0;
  virtual Backend backend() const = 0;
};

// How a write under a discarded tag completes (kCancelled, and only such writes have this status).
absl::Status DiscardedWrite();

using AcceptCallback = std::function<void(std::shared_ptr<Connection>)>;
// A listener's judgement of a peer that proved the cluster key, by the name it proved, before the
// handshake's ACCEPT goes out: OK admits it. An error refuses it in the handshake, in place of the
// ACCEPT, so the dialer's connect fails with that code and the reason, naming the listener:
// kUnavailable means "not now" (e.g. the peer's previous connection has not been seen to end yet),
// and the dialer tries again with its backoff until its connect timeout; any other code is final.
// It runs on a handshake thread and must not block. Empty admits every peer.
using AdmitCallback = std::function<absl::Status(const std::string& peer_name)>;

class Listener {
 public:
  virtual ~Listener() = default;
  // The endpoint peers connect to (the actual port when port 0 was asked for).
  virtual Endpoint endpoint() const = 0;
};

// Bounds on what peers can make this process spend. Each is a TF_RDMA_* variable (settings.h); a
// peer that goes past one fails with an error naming the limit and its variable.
struct TransportLimits {
  // Handshakes a listener runs at once, a thread and a descriptor each
  // (TF_RDMA_MAX_CONCURRENT_HANDSHAKES), at most half of them for one source address; a client
  // holds one only from its first byte on. Clients beyond it are refused at once, and Connect
  // tries again with its backoff until the connect timeout.
  size_t max_concurrent_handshakes = settings::kMaxConcurrentHandshakes.default_value;
  // Grants a peer may have outstanding here that no write has used yet
  // (TF_RDMA_MAX_GRANTS_PER_PEER). tf_rdma's receivers keep two per transfer in flight.
  size_t max_grants_per_peer = settings::kMaxGrantsPerPeer.default_value;
  // shm: bytes of a peer's shared regions this process maps (TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER).
  uint64_t shm_max_mapped_bytes_per_peer = settings::kShmMaxMappedBytesPerPeer.default_value;
  // shm: bytes of all peers' regions this process maps at once (TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL),
  // so that connections each within their share cannot together take the address space.
  uint64_t shm_max_mapped_bytes_total = settings::kShmMaxMappedBytesTotal.default_value;
  // Live connections of one backend with peers claiming the same task name
  // (TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME). tf_rdma keeps one per pair of tasks, and for a
  // moment two while one replaces the other; a key holder opening many is refused past this.
  size_t max_connections_per_peer_name = settings::kMaxConnectionsPerPeerName.default_value;
};

// The verbs backend's overrides (TF_RDMA_VERBS_*, settings.h); empty / 0 / -1 mean "whatever rdma_cm
// resolves for the peer's IP address" (the device and port that carry it, the RoCE v2 GID of the
// local address).
struct VerbsSettings {
  std::string device;
  int port = settings::kVerbsPort.default_value;
  int gid_index = settings::kVerbsGidIndex.default_value;
  // How long the I/O thread serving a verbs connection keeps polling its completion queue after
  // the last completion before it sleeps on the completion channel (TF_RDMA_VERBS_POLL_US).
  absl::Duration poll_window = settings::kVerbsPollUs.default_duration();
};

struct TransportOptions {
  // Who this process is, for the peer's error messages (e.g. "/job:worker/replica:0/task:1").
  std::string local_name;
  // Peers prove they hold the same key in the handshake; see handshake.h. Callers derive it from
  // TF_RDMA_SECRET alone, not from the cluster's shape (ClusterKey, config.h).
  std::string cluster_key;
  // A peer that sends nothing (not even a heartbeat) for this long is declared dead.
  absl::Duration peer_timeout = settings::kPeerTimeoutMs.default_duration();
  absl::Duration connect_timeout = settings::kConnectTimeoutMs.default_duration();
  // The threads that serve all of this transport's connections (TF_RDMA_IO_THREADS).
  size_t io_threads = settings::kIoThreads.default_value;
  // tcp and shm: how long an I/O thread keeps polling its sockets after it last served one before
  // it sleeps (TF_RDMA_STREAM_POLL_US; IoLoops).
  absl::Duration stream_poll_window = settings::kStreamPollUs.default_duration();
  // Overrides the wire protocol version this process announces. Only tests set it, to prove that a
  // mismatch between two builds is reported.
  uint32_t protocol_version_override = 0;
  TransportLimits limits;
  VerbsSettings verbs;
};

// One backend's view of this process: the memory it can grant, and its connections.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual Backend backend() const = 0;
  virtual absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateRegion(size_t bytes) = 0;
  virtual absl::StatusOr<std::unique_ptr<Listener>> Listen(const Endpoint& endpoint,
                                                           AcceptCallback on_accept,
                                                           AdmitCallback admit) = 0;
  virtual absl::StatusOr<std::shared_ptr<Connection>> Connect(const Endpoint& endpoint) = 0;
};

// Fails, naming the backend and why, where it cannot work (BackendAvailable, backend_registry.h).
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(Backend backend,
                                                           const TransportOptions& options);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_TRANSPORT_H_
