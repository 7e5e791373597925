// A Connection over one reliable-connected queue pair.
//
// Data moves with RDMA WRITE straight from the sender's buffer into the receiver's granted range:
// a message of up to kMaxSingleWrite bytes is one WRITE_WITH_IMM whose immediate is the grant id
// (the receiver's completion carries the length); a bigger one is a series of WRITEs followed by a
// DATA message. RC ordering puts a DATA message after the WRITEs it reports.
//
// Grants travel the other way without a round trip: each side keeps a grant table (fixed-size
// slots in pages of their own, registered for remote write and holding nothing else) and announces
// it once, in a GRANT_TABLE message right after the handshake. The granter writes the grant record
// into a free slot of the peer's table with one WRITE_WITH_IMM whose immediate is kGrantImmBit |
// slot (grant ids stay below kGrantImmBit, so the two kinds of immediate cannot be confused); the
// sender's completion names the slot, and it reads the record from there at once and checks it as
// untrusted input. The granter takes the slot back when the grant is resolved (its data landed,
// TOO_SMALL, REVOKED): the sender sends each of those only after it read the slot, so a slot is
// never rewritten while unread and reuse needs no message of its own. A grant finding no free slot
// waits, in grant order, until one frees; a grant is written only once every control message
// queued before it was posted, so the REGION it refers to precedes it on the queue pair.
//
// Everything else (handshake, REGION, GRANT_TABLE, TOO_SMALL, REVOKE, REVOKED, PING, REJECT) is a
// small SEND into receive buffers the peer keeps posted. No thread is the connection's own: one of
// the transport's I/O loops (io_loops.h) serves it, woken through an epoll descriptor holding the
// connection's completion channel, rdma_cm event channel and wake-up eventfd, and ticks it to send
// heartbeats, so a dead or silent peer fails every pending operation within
// TransportOptions::peer_timeout.
//
// The parts: QueuePair (queue_pair.h) holds the verbs objects, GrantTables (grant_table.h) the
// grant-table slots, verbs_memory.h the registered regions and memory windows. The connection's own
// state is under one mutex, its methods in four files: verbs_connection.cc (creation, the handshake
// channel, the Connection calls), verbs_posting.cc (work requests), verbs_progress.cc (the loop's
// side: completions, rdma_cm events, the peer's messages) and verbs_closing.cc (failure and close).
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_VERBS_CONNECTION_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_VERBS_CONNECTION_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/transport/grant_book.h"
#include "cc/transport/handshake.h"
#include "cc/transport/io_loops.h"
#include "cc/transport/transport.h"
#include "cc/transport/verbs/grant_table.h"
#include "cc/transport/verbs/queue_pair.h"
#include "cc/transport/verbs/registration_cache.h"
#include "cc/transport/verbs/verbs_device.h"
#include "cc/transport/verbs/verbs_memory.h"
#include "cc/transport/verbs/verbs_messages.h"

namespace tf_rdma::verbs {

class VerbsConnection : public Connection,
                        public IoHandler,
                        public std::enable_shared_from_this<VerbsConnection> {
 public:
  // Takes ownership of `id` (whose event channel is its own) and builds the queue pair on it, in
  // RESET state; the caller moves it to RTS with Transition() while rdma_cm connects.
  static absl::StatusOr<std::shared_ptr<VerbsConnection>> Create(
      rdma_cm_id* id, rdma_event_channel* events, std::shared_ptr<DeviceContext> device,
      const TransportOptions& options, const VerbsSettings& settings, std::string peer_address);
  ~VerbsConnection() override;

  uint32_t qp_num() const { return queue_pair_.qp()->qp_num; }
  // Moves the QP to `state` with the attributes rdma_cm computed, and the GID/port overrides.
  absl::Status Transition(ibv_qp_state state);
  // How often the transport's loops tick its connections: an eighth of the peer timeout, so a
  // silent peer is noticed in time, and at most kCloseTick, so a closing connection stops waiting
  // for its REJECT on time.
  static absl::Duration LoopTick(const TransportOptions& options);
  // Has one of `loops` serve the connection from now on; control messages received until
  // Established() go to the handshake channel.
  void Start(IoLoops& loops);
  FrameChannel& handshake_channel() { return channel_; }
  void Established(const PeerIdentity& peer);

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
  Backend backend() const override { return Backend::kVerbs; }

  // Waits (the transport's shutdown) until its loop finished the closed connection: its REJECT
  // sent and its work requests flushed, or their time limits passed.
  void AwaitFinished();

  // IoHandler, on the loop's thread.
  Progress OnEvents(uint32_t events) override;
  bool OnTick(absl::Time now) override;
  void OnLoopStopped() override;
  void OnRemoved() override {}

 private:
  class Channel : public FrameChannel {
   public:
    explicit Channel(VerbsConnection* connection) : connection_(connection) {}
    absl::Status Send(const wire::Frame& frame) override;
    absl::StatusOr<wire::Frame> Receive(absl::Time deadline) override;
    std::string PeerAddress() const override { return connection_->peer_address_; }

   private:
    VerbsConnection* const connection_;
  };
  struct RemoteRegion {
    uint64_t address;
    uint64_t size;
    uint32_t rkey;
  };
  struct PendingWrite {
    const void* src;
    uint64_t length;
    std::shared_ptr<Registration> registration;
    WriteDone done;
  };
  struct Outgoing {
    wire::Grant grant;
    PendingWrite write;
    uint64_t posted = 0;  // bytes of the message already posted
  };
  // Remote-write access this connection gives its peer to one region, or to its grant table.
  struct Window {
    std::shared_ptr<MemoryWindow> mw;  // none where the device has no windows: the key is the registration's
    ibv_mw_bind_info bind{};  // the registration, range and access the bind gives (ibv_bind_mw(3))
    uint32_t rkey = 0;     // the key the peer is told: the window's, incremented (ibv_inc_rkey(3))
    bool bound = true;     // false until the bind is posted on this queue pair
    std::weak_ptr<MemoryRegion> region;  // whose window it is; none: the grant table's
  };
  struct QueuedControl {
    std::string message;
    Window* bind_first = nullptr;  // bound on the send queue ahead of the message announcing it
    std::shared_ptr<MemoryRegion> region;  // keeps that window's region until the bind completed
  };
  // What a posted work request's completion means.
  struct InFlight {
    int send_slot = -1;     // a control message's buffer to free
    uint64_t bytes = 0;     // data bytes it carried (the in-flight window)
    bool is_reject = false;
    WriteDone done;         // the message's last work request: the write is complete
    std::shared_ptr<Registration> registration;
    std::shared_ptr<MemoryRegion> region;  // a window's, while its bind is in flight
  };

  static constexpr int kSendDepth = QueuePair::kSendDepth;
  static constexpr size_t kSlotSize = QueuePair::kSlotSize;
  // One WRITE_WITH_IMM carries messages up to this size (or the port's max_msg_sz, if smaller:
  // ibv_query_port(3)); beyond, WRITEs and a DATA message.
  static constexpr uint64_t kMaxSingleWrite = uint64_t{16} << 20;
  // Bigger messages go in WRITEs of this size.
  static constexpr uint64_t kMultiPartChunk = uint64_t{4} << 20;
  // At most this many data bytes are posted and not completed per connection, so a heartbeat or grant
  // posted behind data waits for at most that much to drain (a slow link must not look like a dead
  // peer). It admits four messages of the largest single write, as many as a receiver granting four
  // ahead lets be in flight, so they follow one another on the wire without a round trip between
  // them. 64 MiB drains in about 5 ms at 100 Gb/s and in 3-4 s on Soft-RoCE under TCG (~20 MB/s),
  // far inside the default peer timeout (30 s); the price is that a grant queued behind a full window
  // reaches the peer that much later, while its data towards us waits for it.
  static constexpr uint64_t kWriteWindow = 4 * kMaxSingleWrite;
  // In a work request's id (ibv_wc::wr_id): a receive's, whose low bits are its buffer's slot.
  // Send work requests are numbered from 1 below it.
  static constexpr uint64_t kReceiveBit = uint64_t{1} << 63;

  // ---- verbs_connection.cc: creation, the handshake, the Connection calls ----
  VerbsConnection(rdma_cm_id* id, rdma_event_channel* events, std::shared_ptr<DeviceContext> device,
                  const TransportOptions& options, const VerbsSettings& settings,
                  std::string peer_address);
  absl::Status Setup();
  // Queues what the grant book decided: TOO_SMALL and WITHDRAWN answers, then the paired message.
  void EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing);
  // Has the loop serve the connection now (a close, the end of the handshake).
  void Wake();

  // ---- verbs_posting.cc: work requests on the queue pair ----
  absl::Status PostReceive(int slot);
  // Fills `window` for [addr, addr + length) of `registration`: a type 2 window (shared with
  // `owner`, else this connection's own) bound later to this queue pair where the device has them, else
  // the registration's own key.
  absl::Status OpenWindow(Window& window, const Registration& registration, const void* addr,
                          uint64_t length, VerbsRegion* owner);
  absl::Status PostBindLocked(Window& window, std::shared_ptr<MemoryRegion> region);
  void EnqueueControlLocked(std::string message, Window* bind_first = nullptr,
                            std::shared_ptr<MemoryRegion> region = nullptr);
  // Forgets the windows of regions that are gone, so a connection granting a fresh region per
  // transfer does not accumulate them.
  void SweepWindowsLocked();
  void EnqueueFrameLocked(const wire::Frame& frame) { EnqueueControlLocked(wire::Encode(frame)); }
  // Posts as much of the outgoing queue as the send queue, send buffers and window allow.
  void PumpLocked();
  bool PostDataLocked(Outgoing& item);
  // Posts `message` from a send buffer: as a SEND, or with `table_slot` >= 0 as the WRITE_WITH_IMM
  // of a grant record into that slot of the peer's grant table.
  absl::Status PostControlLocked(const std::string& message, bool is_reject, int table_slot = -1);

  // ---- verbs_progress.cc: completions, rdma_cm events and the peer's messages, on the loop ----
  // Handles the completions there are (a burst: until the queue stays empty), at most a bounded
  // number per call; true if it stopped at that bound (completions may be left).
  bool PollCompletions(std::vector<std::function<void()>>* callbacks);
  void HandleCmEvents(std::vector<std::function<void()>>* callbacks);
  // Whether the established connection has heard nothing for longer than the peer timeout.
  bool SilentPastTimeout(absl::Time now) const;
  // OnTick's, once the peer has been silent for half the peer timeout: true if packets of the
  // peer's arrived since the previous call, which came after the last message received.
  bool PeerPacketsArrivedLocked(absl::Time now);
  void TakeLoopCallbacksLocked(std::vector<std::function<void()>>* callbacks);
  void HandleCompletion(const ibv_wc& wc, std::vector<std::function<void()>>* callbacks);
  void DrainInboxLocked(std::vector<std::function<void()>>* callbacks);
  absl::Status HandleMessageLocked(std::string_view bytes, std::vector<std::function<void()>>* callbacks);
  absl::Status DispatchLocked(wire::Frame frame, std::vector<std::function<void()>>* callbacks);
  absl::Status OnGrantTableLocked(const GrantTableMessage& table);
  absl::Status OnGrantWrittenLocked(uint32_t table_slot, uint32_t length);
  absl::Status OnRemoteGrantLocked(const wire::Grant& grant);
  absl::Status OnDataLocked(uint64_t grant_id, uint64_t length, std::vector<std::function<void()>>* callbacks);
  absl::Status OnGrantReturnedLocked(uint64_t grant_id, GrantResult result, bool must_exceed_capacity,
                                     std::vector<std::function<void()>>* callbacks);
  void OnPeerRevokeLocked(uint64_t grant_id);
  // The peer discarded `tag` (DISCARD): the writes waiting under it complete as cancelled.
  void OnPeerDiscardLocked(const Tag& tag, std::vector<std::function<void()>>* callbacks);
  absl::Status OnWithdrawnLocked(const wire::Withdrawn& withdrawn, std::vector<std::function<void()>>* callbacks);
  // Checks that grant `grant_id`, which the peer is answering with `answer`, was written to its
  // grant table (else the peer cannot know it).
  absl::Status CheckWrittenLocked(uint64_t grant_id, std::string_view answer) const;

  // ---- verbs_closing.cc: failure and close ----
  // Sets the error `reason`; the peer gets `told_peer` (a REJECT) first, if given. Callbacks run by
  // the caller, unlocked.
  void FailLocked(const absl::Status& reason, const std::optional<absl::Status>& told_peer,
                  std::vector<std::function<void()>>* callbacks);
  // Stops the QP (no write can land any more) and fails the grants; lock held.
  void StopQueuePairLocked(std::vector<std::function<void()>>* callbacks);
  // A closed connection's way out: stops the QP when its REJECT went out or kRejectGrace passed,
  // and once the work requests are flushed (or kFlushLimit passed) completes what they carried.
  // True when the connection is finished and its loop may let go of it.
  bool SettleCloseLocked(absl::Time now, std::vector<std::function<void()>>* callbacks);
  // Completes the writes whose work requests may still be posted: their buffers are free again.
  void CompletePostedLocked(std::vector<std::function<void()>>* callbacks);
  absl::Status PeerError(const absl::Status& cause) const;
  // Explains a failed work completion (ibv_wc_status_str(3)), and a port no longer ACTIVE.
  absl::Status CompletionError(const ibv_wc& wc) const;

  const std::shared_ptr<DeviceContext> device_;
  const TransportOptions options_;
  const VerbsSettings settings_;
  const std::string peer_address_;
  std::string peer_name_;
  std::string peer_build_;  // set with peer_name_, before the connection is handed out
  Channel channel_{this};

  // Declared first, destroyed last: the queue pair through which the peer writes our grant table
  // goes first.
  GrantTables grant_tables_;  // guarded by mu_ once Setup() returned
  QueuePair queue_pair_;      // immutable once Setup() returned
  uint64_t max_single_write_ = 0;

  // Guards every member below (but last_completion_), and grant_tables_.
  mutable std::mutex mu_;
  std::condition_variable handshake_cv_;
  absl::Status status_;
  bool established_ = false;
  bool stopped_ = false;              // QP moved to error, grants failed
  bool finished_ = false;             // flushed: the loop let go of it (finished_cv_)
  std::condition_variable finished_cv_;
  absl::Time stop_deadline_;          // when a REJECT in flight stops waiting
  std::deque<std::string> handshake_inbox_;
  std::vector<int> free_send_slots_;  // of QueuePair::send_buffer()
  // Send work requests posted and not completed: at most QueuePair::kSendDepth, the send queue's
  // max_send_wr (ibv_create_qp(3)). Binds, SENDs and WRITEs alike.
  int posted_sends_ = 0;
  int posted_receives_ = 0;  // receive buffers posted (ibv_post_recv(3)) and not completed
  uint64_t window_bytes_ = 0;  // data bytes posted and not completed
  uint64_t next_wr_id_ = 1;    // ibv_send_wr::wr_id of the next send work request
  std::unordered_map<uint64_t, InFlight> in_flight_;  // by wr_id, until its completion
  // Control messages go first, so a long message does not hold back heartbeats and grants.
  std::deque<QueuedControl> control_queue_;
  std::deque<Outgoing> data_queue_;
  std::vector<WriteDone> deferred_write_dones_;  // partly posted writes: done once flushed
  // Callbacks a call decided but may not run itself (transport.h): the loop runs them.
  std::vector<std::function<void()>> loop_callbacks_;
  // Grant ids travel as immediates below kGrantImmBit.
  GrantBook<PendingWrite> book_{kGrantImmBit - 1, options_.limits.max_grants_per_peer};
  Window grant_table_window_;
  std::unordered_map<uint32_t, Window> region_windows_;  // regions announced to the peer, by id
  size_t sweep_at_ = 64;                                 // region_windows_ size of the next sweep
  std::unordered_map<uint32_t, RemoteRegion> remote_regions_;  // the peer's REGIONs, by id
  absl::Time last_receive_;  // of a message, or of packets PeerPacketsArrivedLocked saw
  absl::Time last_send_;
  uint32_t receive_psn_ = 0;                              // QueuePair::NextReceivePsn when last asked
  absl::Time receive_psn_asked_ = absl::InfinitePast();  // when that was
  absl::Time last_completion_ = absl::InfinitePast();  // the loop's thread only
};

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_VERBS_CONNECTION_H_
