// A Connection over a stream socket, shared by the tcp and shm backends. It has no thread of its
// own: the transport's I/O loop it belongs to (io_loops.h) takes frames off the socket when it is
// readable, sends what callers could not send at once when it is writable, and every tick sends a
// heartbeat when nothing else went out and ends the connection when the peer went silent for
// TransportOptions::peer_timeout. Backends supply only the payload path (how a message reaches a
// granted range).
#ifndef TF_RDMA_CC_TRANSPORT_STREAM_STREAM_CONNECTION_H_
#define TF_RDMA_CC_TRANSPORT_STREAM_STREAM_CONNECTION_H_

#include <atomic>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "cc/transport/grant_book.h"
#include "cc/transport/handshake.h"
#include "cc/transport/io_loops.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/transport.h"
#include "cc/transport/wire.h"

namespace tf_rdma {

class StreamConnection : public Connection,
                         public IoHandler,
                         public std::enable_shared_from_this<StreamConnection> {
 public:
  // Takes ownership of `fd`, a connected socket whose handshake is done.
  StreamConnection(int fd, Backend backend, const PeerIdentity& peer, std::string peer_address,
                   const TransportOptions& options);
  ~StreamConnection() override;
  // Hands the socket to `loop`, which keeps the connection alive until it is closed. When it
  // cannot, the connection is closed and this says why.
  absl::Status Start(std::shared_ptr<IoLoop> loop);

  uint64_t Grant(const Tag& tag, std::shared_ptr<MemoryRegion> region, uint64_t offset,
                 uint64_t capacity, GrantDone done) override;
  void Revoke(uint64_t grant_id) override;
  void DiscardPeerWrites(const Tag& tag) override;
  void Write(const Tag& tag, const void* src, uint64_t length, WriteDone done) override;
  void Withdraw(const Tag& tag, const absl::Status& why) override;
  void Close(const absl::Status& reason) override;
  absl::Status health() const override;
  const std::string& peer_name() const override { return peer_name_; }
  const std::string& peer_build() const override { return peer_build_; }
  Backend backend() const override { return backend_; }

  // IoHandler, on the loop's thread.
  Progress OnEvents(uint32_t events) override;
  bool OnTick(absl::Time now) override;
  void OnLoopStopped() override;
  // The connection failed and its loop let go of it: the socket is released now, not when the
  // last user lets go of the connection (a peer that never comes back would keep it for good).
  void OnRemoved() override;

 protected:
  // A frame to send, with the descriptor that rides along (shm regions) and what must outlive it.
  struct ControlFrame {
    wire::Frame frame;
    int pass_fd = -1;
    std::shared_ptr<MemoryRegion> keep_alive;
  };

  // Receiver side: whether peers of this backend can be granted ranges of `region`.
  virtual absl::Status CheckLocalRegion(const MemoryRegion& region) { return absl::OkStatus(); }
  // Receiver side, called with the connection's lock held: a frame the sender needs before it can
  // use a grant of `region` (shm: the region's descriptor, once per connection).
  virtual std::optional<ControlFrame> FrameBeforeGrant(const std::shared_ptr<MemoryRegion>& region) {
    return std::nullopt;
  }
  // Receiver side, every tick with the connection's lock held: frames the sender needs about
  // regions that are gone (shm: which to unmap).
  virtual std::vector<ControlFrame> FramesForGoneRegionsLocked() { return {}; }
  // Sender side, I/O thread: whether the peer's grant can be used at all.
  virtual absl::Status CheckRemoteGrant(const wire::Grant& grant) { return absl::OkStatus(); }
  // Sender side: makes the message reach the grant before its DATA frame is sent. Returns true
  // when the payload instead travels on the stream right after the DATA frame (tcp).
  virtual absl::StatusOr<bool> PlaceMessage(const wire::Grant& grant, const void* src,
                                            uint64_t length) = 0;
  // Receiver side: whether a DATA frame's payload follows it on the stream (tcp), rather than
  // being in the granted range already (shm).
  virtual bool PayloadOnStream() const = 0;
  // Sender side, I/O thread: a SHM_REGION frame arrived with descriptor `fd` (or -1).
  virtual absl::Status OnShmRegion(const wire::ShmRegion& region, int fd);
  // Sender side, I/O thread: a SHM_REGION_GONE frame arrived.
  virtual absl::Status OnShmRegionGone(const wire::ShmRegionGone& gone);

  const std::string& peer_address() const { return peer_address_; }
  const TransportOptions& options() const { return options_; }

 private:
  struct PendingWrite {
    const void* src;
    uint64_t length;
    WriteDone done;
  };
  struct Outgoing {
    std::optional<ControlFrame> control;
    // A message, when control is empty.
    wire::Grant grant;
    PendingWrite write;
    // Set once the item went partly out: its encoded head, the payload that follows it on the
    // stream, and how many bytes of both the socket took. write.done (if any) runs once all did.
    bool started = false;
    std::string head;
    const char* payload = nullptr;
    uint64_t payload_length = 0;
    uint64_t sent = 0;
  };
  // What one send gathers: a few items, kept inline, so a send allocates no list of them.
  using OutgoingBatch = absl::InlinedVector<Outgoing, 4>;
  // A DATA frame's payload on its way off the stream into the grant it fills.
  struct IncomingPayload {
    IssuedGrant grant;
    char* dst;
    uint64_t length;
    uint64_t received = 0;
  };

  // Takes what the socket holds off it and acts on it, a bounded amount per call: true when
  // bytes read already are left for the next call.
  bool ReadAvailable();
  // One frame, or one payload piece, read and acted on; `progressed` false when the socket had
  // nothing more. An allocation failure becomes kResourceExhausted.
  absl::Status ReadStep(bool* progressed);
  absl::Status ReadAndDispatch(bool* progressed);
  absl::Status ReceivePayload(bool* progressed);
  // Sends what callers left queued, when the socket is writable.
  void SendQueued();
  // The connection ended: what only the loop's thread holds goes back (the payload's grant).
  void Finish();
  // Descriptors ride only on SHM_REGION frames, one each: past `allowed`, every descriptor the
  // peer passed is closed and the connection fails, so a peer cannot make us hold any.
  absl::Status RefuseStrayDescriptors(size_t allowed, const char* frame_type);
  // Moves the descriptors that came with the bytes read so far to received_fds_.
  void CollectDescriptors();
  absl::Status Dispatch(wire::Frame frame);
  absl::Status OnRemoteGrant(const wire::Grant& grant);
  absl::Status OnData(const wire::Data& data);
  absl::Status OnGrantReturned(uint64_t grant_id, GrantResult result, bool must_exceed_capacity);
  void OnPeerRevoke(uint64_t grant_id);
  // The peer discarded `tag` (DISCARD): the writes waiting under it complete as cancelled.
  void OnPeerDiscard(const Tag& tag);
  absl::Status OnWithdrawn(const wire::Withdrawn& withdrawn);
  // Queues what the grant book decided: TOO_SMALL and WITHDRAWN answers, then the paired message.
  // Lock held.
  void EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing);
  void EnqueueLocked(Outgoing item);
  // Sends what is queued from the calling thread while it is cheap (control frames, small
  // messages) and the socket takes it without blocking; the I/O loop does the rest once the
  // socket is writable. This saves a thread hand-off per message, which dominates small-message
  // latency. On the loop's thread while it handles this connection's events, it sends nothing:
  // OnEvents sends what they queued in one go when they are handled.
  void FlushLocked(std::unique_lock<std::mutex>& lock);
  static bool Cheap(const Outgoing& item);
  // Whether the loop tells us when the socket is writable: while something waits to be sent.
  void WatchWritableLocked(bool writable);
  // Takes the items one send gathers off the queue's front, in order (at least one): up to
  // kIovecsPerSend iovecs and kBytesPerSend message bytes, only cheap ones if `cheap_only`, and an
  // item that passes a descriptor alone.
  OutgoingBatch TakeBatchLocked(bool cheap_only);
  // Encodes the item's frame and places its message (once, before its first byte goes out).
  absl::Status Prepare(Outgoing& item);
  // Puts batch[from...] back at the front of the queue, in order, and leaves batch[0, from). When
  // the connection closed meanwhile, their writes complete with its error instead: false.
  bool RequeueFront(OutgoingBatch& batch, size_t from);
  // Puts what the socket takes of `batch` on the wire in one send without blocking. False when it
  // did not take all: the rest went back to the front of the queue, for the loop.
  bool Transmit(OutgoingBatch batch);
  // Fails the connection with `reason`; the peer gets `told_peer` (a REJECT frame) if given.
  void CloseInternal(const absl::Status& reason, const std::optional<absl::Status>& told_peer);
  // Whether bytes (or the peer's FIN) wait unread in the socket: a process that was stopped finds
  // what its peer sent meanwhile there, and that peer was not silent.
  bool UnreadBytesWaiting() const;
  // Turns a failure on the stream into the error users see, naming the peer and the likely fix.
  absl::Status PeerError(const absl::Status& cause) const;

  // The socket; -1 once OnRemoved closed it. Written with both send_mu_ and mu_ held, so either
  // lock suffices to read it: no path touches the number after it was closed, when the kernel may
  // already have handed it to another socket.
  int fd_;
  const Backend backend_;
  const std::string peer_name_;
  const std::string peer_build_;
  const std::string peer_address_;
  const TransportOptions options_;

  mutable std::mutex mu_;
  absl::Status status_;
  GrantBook<PendingWrite> book_{std::numeric_limits<uint64_t>::max(),
                               options_.limits.max_grants_per_peer};
  std::deque<Outgoing> outgoing_;
  bool sending_ = false;  // someone holds the socket's send side (the loop or an inline flush)
  bool send_broken_ = false;  // a send failed; the loop is about to end the connection
  std::shared_ptr<IoLoop> loop_;  // set by Start
  bool writable_watched_ = false;  // guarded by mu_

  // Held around send and shutdown syscalls, so Close's last word never splits a frame and no
  // syscall meets a closed fd_. Sends never block, so it is held for one syscall at a time.
  std::mutex send_mu_;
  // Set by every send that put bytes on the wire; the tick takes it (heartbeats).
  std::atomic<bool> sent_since_tick_{false};

  // The loop's thread only: the stream, the descriptors the frame at hand brought, the payload
  // being received, and when the peer was last heard from and we last sent.
  StreamReader reader_{fd_};
  std::deque<int> received_fds_;
  std::optional<IncomingPayload> payload_;
  // Message bytes the current ReadAvailable moved or let go (its turn's budget, kBytesPerTurn).
  uint64_t moved_this_turn_ = 0;
  bool heard_since_tick_ = false;
  absl::Time last_heard_;
  absl::Time last_sent_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_STREAM_STREAM_CONNECTION_H_
