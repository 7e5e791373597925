// A Connection over a stream socket, shared by the tcp and shm backends. One reader thread takes
// frames off the socket; one writer thread sends queued frames and messages, and a heartbeat when
// idle, so that a peer that goes silent is noticed within TransportOptions::peer_timeout.
// Backends supply only the payload path (how a message reaches a granted range).
#ifndef TF_RDMA_CC_TRANSPORT_STREAM_STREAM_CONNECTION_H_
#define TF_RDMA_CC_TRANSPORT_STREAM_STREAM_CONNECTION_H_

#include <condition_variable>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cc/transport/grant_book.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/transport.h"
#include "cc/transport/wire.h"

namespace tf_rdma {

class StreamConnection : public Connection, public std::enable_shared_from_this<StreamConnection> {
 public:
  // Takes ownership of `fd`, a connected socket whose handshake is done.
  StreamConnection(int fd, Backend backend, std::string peer_name, std::string peer_address,
                   const TransportOptions& options);
  ~StreamConnection() override;
  // Starts the reader and writer threads; they keep the connection alive until it is closed.
  // When they cannot start, the connection is closed and this says why.
  absl::Status Start();

  uint64_t Grant(const Tag& tag, std::shared_ptr<MemoryRegion> region, uint64_t offset,
                 uint64_t capacity, GrantDone done) override;
  void Revoke(uint64_t grant_id) override;
  void Discard(const Tag& tag) override;
  void Write(const Tag& tag, const void* src, uint64_t length, WriteDone done) override;
  void Withdraw(const Tag& tag) override;
  void Close(const absl::Status& reason) override;
  absl::Status health() const override;
  const std::string& peer_name() const override { return peer_name_; }
  Backend backend() const override { return backend_; }

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
  // Sender side, reader thread: whether the peer's grant can be used at all.
  virtual absl::Status CheckRemoteGrant(const wire::Grant& grant) { return absl::OkStatus(); }
  // Sender side: makes the message reach the grant before its DATA frame is sent. Returns true
  // when the payload instead travels on the stream right after the DATA frame (tcp).
  virtual absl::StatusOr<bool> PlaceMessage(const wire::Grant& grant, const void* src,
                                            uint64_t length) = 0;
  // Receiver side, reader thread: a DATA frame for a grant at `dst` arrived; lands the payload.
  virtual absl::Status ReceiveMessage(char* dst, uint64_t length) = 0;
  // Sender side, reader thread: a SHM_REGION frame arrived with descriptor `fd` (or -1).
  virtual absl::Status OnShmRegion(const wire::ShmRegion& region, int fd);

  // For ReceiveMessage: reads payload bytes off the stream.
  absl::Status ReceiveRaw(char* dst, uint64_t length);
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
    // What a non-blocking send left unsent; write.done (if any) runs once it is out.
    std::optional<std::string> remainder;
  };

  void ReadLoop();
  // One frame read and acted on; an allocation failure becomes kResourceExhausted.
  absl::Status ReadOneFrame();
  absl::Status ReadAndDispatch();
  void WriteLoop();
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
  // Queues what the grant book decided: TOO_SMALL answers, then the paired message. Lock held.
  void EnqueuePairingLocked(GrantBook<PendingWrite>::Pairing pairing);
  void EnqueueLocked(Outgoing item);
  // Sends what is queued from the calling thread while it is cheap (control frames, small
  // messages) and the socket takes it without blocking; the writer thread does the rest. This
  // saves a thread hand-off per message, which dominates small-message latency.
  void FlushLocked(std::unique_lock<std::mutex>& lock);
  static bool Cheap(const Outgoing& item);
  // Puts `item` on the wire. Non-blocking: whatever the socket does not take at once goes back to
  // the front of the queue as a remainder for the writer thread.
  void Transmit(Outgoing item, bool nonblocking);
  void CloseInternal(const absl::Status& reason, bool tell_peer);
  // Turns a failure on the stream into the error users see, naming the peer and the likely fix.
  absl::Status PeerError(const absl::Status& cause) const;

  const int fd_;
  const Backend backend_;
  const std::string peer_name_;
  const std::string peer_address_;
  const TransportOptions options_;

  mutable std::mutex mu_;
  std::condition_variable writer_wakeup_;
  absl::Status status_;
  GrantBook<PendingWrite> book_{std::numeric_limits<uint64_t>::max(),
                               options_.limits.max_grants_per_peer};
  std::deque<Outgoing> outgoing_;
  bool sending_ = false;  // someone holds the socket's send side (writer or an inline flush)
  bool send_broken_ = false;  // a send failed; the reader is about to end the connection

  // Held around send syscalls, so Close's last word never splits a frame.
  std::timed_mutex send_mu_;
  // Reader thread only: the stream, and the descriptors the frame at hand brought.
  StreamReader reader_{fd_};
  std::deque<int> received_fds_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_STREAM_STREAM_CONNECTION_H_
