// Blocking socket I/O for the stream backends: whole-buffer sends and receives that survive partial
// transfers and EINTR, carry file descriptors (shm), and report a silent peer instead of waiting
// forever.
#ifndef TF_RDMA_CC_TRANSPORT_STREAM_SOCKET_IO_H_
#define TF_RDMA_CC_TRANSPORT_STREAM_SOCKET_IO_H_

#include <sys/uio.h>

#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cc/transport/errno_message.h"
#include "cc/transport/handshake.h"
#include "cc/transport/wire.h"

namespace tf_rdma {

// Sends every byte of `iov`; `pass_fd` (if >= 0) rides along as SCM_RIGHTS on the first byte.
absl::Status SendAll(int fd, std::vector<iovec> iov, int pass_fd = -1);

// One non-blocking attempt: how many bytes of `iov` the socket took (0 if it would block).
absl::StatusOr<size_t> SendWithoutBlocking(int fd, const std::vector<iovec>& iov, int pass_fd = -1);

// Bounds how long a receive on `fd` waits for the next byte (SO_RCVTIMEO): the kernel keeps the
// clock, so a receive costs one syscall, as a plain blocking read does.
absl::Status SetReceiveTimeout(int fd, absl::Duration limit);

// One receive into [dst, dst + capacity): how many bytes came (at least one), with
// ReceiveExact's errors; descriptors as for ReceiveExact. `nonblocking`: 0 when nothing was there.
absl::StatusOr<size_t> ReceiveSome(int fd, char* dst, size_t capacity, std::deque<int>* received_fds,
                                   bool nonblocking = false);

// Fills [dst, dst + length). Fails with kUnavailable when the peer closed the stream and with
// kDeadlineExceeded when no byte arrived within the receive timeout, or when `deadline` (if not
// infinite) passed: a peer that trickles bytes cannot stretch it. Descriptors passed by the peer
// are appended to `received_fds` (owned by the caller) when it is not null, else closed; when the
// kernel dropped some (MSG_CTRUNC), none are, and it fails: kResourceExhausted naming
// RLIMIT_NOFILE when this process had no descriptor left to receive one, kDataLoss when the peer
// passed more with one send than a tf_rdma peer does.
absl::Status ReceiveExact(int fd, char* dst, size_t length, std::deque<int>* received_fds,
                          absl::Time deadline = absl::InfiniteFuture());

// Reads one frame header and body.
absl::StatusOr<wire::Frame> ReceiveFrame(int fd, std::deque<int>* received_fds,
                                         absl::Time deadline = absl::InfiniteFuture());

// A connection's receiving side, read through a buffer without ever waiting (the I/O loop calls
// it when the socket is readable): the small frames of a burst (grants, inline messages, their
// DATA frames) cost one receive syscall together instead of two or three each. What does not fit
// the buffer lands in place. The buffer is made on first use and given back once it holds no
// unread bytes and the owner says the connection is quiet, so an idle connection costs none. One thread at a time (the connection's I/O loop).
class StreamReader {
 public:
  explicit StreamReader(int fd);
  ~StreamReader();  // closes the descriptors nobody took
  StreamReader(const StreamReader&) = delete;
  StreamReader& operator=(const StreamReader&) = delete;

  // The next frame once all of it came, else nullopt (the socket had no more for now). Fails with
  // kUnavailable when the peer closed the stream, and on a malformed header.
  absl::StatusOr<std::optional<wire::Frame>> NextFrame();
  // Moves up to `length` payload bytes to `dst`, from the buffer, else from one receive (in place
  // when large): how many, 0 when the socket had none for now.
  absl::StatusOr<size_t> ReadSome(char* dst, size_t length);
  // The descriptors the peer passed with the bytes read so far, oldest first; the caller owns
  // them. The kernel ends a receive with the send that passed a descriptor, so each is charged to
  // the frame whose bytes end at or after where its receive ended: the frame that brought it.
  std::vector<int> TakeDescriptors();
  // The loop found the socket readable: the next read asks it again, even if the last one
  // emptied it.
  void OnReadable() { socket_drained_ = false; }
  // Gives the buffer back if it holds no unread byte.
  void ReleaseIfDrained();
  // The stream is over: gives the buffer back and closes the descriptors not taken.
  void Release();

 private:
  static constexpr size_t kBufferBytes = 64 << 10;
  // One non-blocking receive into `dst`: how many bytes came (0: none there). In place, they
  // count as read by the caller at once; else they extend the buffer's unread bytes. After a
  // receive that came short of `capacity` (it emptied the socket) it asks the socket nothing until
  // OnReadable: the receive that would only say "nothing more" costs a syscall per readable event,
  // and the loop's epoll (level-triggered) reports bytes that came meanwhile.
  absl::StatusOr<size_t> Receive(char* dst, size_t capacity, bool in_place);

  const int fd_;
  std::unique_ptr<char[]> buffer_;
  size_t begin_ = 0;  // the buffer's unread bytes: [begin_, end_)
  size_t end_ = 0;
  uint64_t consumed_ = 0;  // stream positions: bytes read by the caller, and off the socket
  uint64_t received_ = 0;
  bool socket_drained_ = false;
  std::deque<std::pair<uint64_t, int>> descriptors_;  // (position its receive ended at, fd)
  std::deque<int> passed_;  // one receive's descriptors; a member, as a deque allocates when made
};

// The handshake's view of a connected socket.
class SocketFrameChannel : public FrameChannel {
 public:
  SocketFrameChannel(int fd, std::string peer_address)
      : fd_(fd), peer_address_(std::move(peer_address)) {}
  absl::Status Send(const wire::Frame& frame) override;
  absl::StatusOr<wire::Frame> Receive(absl::Time deadline) override;
  std::string PeerAddress() const override { return peer_address_; }

 private:
  const int fd_;
  const std::string peer_address_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_STREAM_SOCKET_IO_H_
