#include "cc/transport/stream/socket_io.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {

namespace {

// One sendmsg of iov[first..]; `pass_fd` (if >= 0) rides along as SCM_RIGHTS.
ssize_t SendOnce(int fd, const std::vector<iovec>& iov, size_t first, int pass_fd, int flags) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov.data()) + first;
  msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
  if (pass_fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &pass_fd, sizeof(int));
  }
  return sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
}

}  // namespace

absl::StatusOr<size_t> SendWithoutBlocking(int fd, const std::vector<iovec>& iov, int pass_fd) {
  while (true) {
    const ssize_t sent = SendOnce(fd, iov, 0, pass_fd, MSG_DONTWAIT);
    if (sent >= 0) return static_cast<size_t>(sent);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return absl::UnavailableError(ErrnoMessage("send failed", errno));
  }
}

absl::Status SendAll(int fd, std::vector<iovec> iov, int pass_fd) {
  size_t first = 0;
  while (first < iov.size()) {
    const ssize_t sent = SendOnce(fd, iov, first, pass_fd, 0);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(ErrnoMessage("send failed", errno));
    }
    pass_fd = -1;  // delivered with the first byte
    size_t left = static_cast<size_t>(sent);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status SetReceiveTimeout(int fd, absl::Duration limit) {
  timeval tv = absl::ToTimeval(std::max(limit, absl::Milliseconds(1)));
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0) {
    return absl::InternalError(ErrnoMessage("setsockopt(SO_RCVTIMEO)", errno));
  }
  return absl::OkStatus();
}

namespace {

// Descriptors one receive takes: a tf_rdma peer passes one per send, and a receive ends with the
// send that passed descriptors.
constexpr size_t kDescriptorsPerReceive = 4;

// Why the kernel dropped descriptors the peer passed (MSG_CTRUNC), given how many it delivered.
// A full control buffer means the peer passed more than it holds; fewer means one could not be
// installed here: this process (or the host) is out of descriptors, no fault of the peer's.
absl::Status DroppedDescriptors(size_t delivered) {
  if (delivered == kDescriptorsPerReceive) {
    return absl::DataLossError(absl::StrCat("the peer passed more than ", kDescriptorsPerReceive,
                                            " file descriptors with one send; a tf_rdma peer passes one"));
  }
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  return absl::ResourceExhaustedError(absl::StrCat(
      "this process is out of file descriptors: one the peer passed (its shared memory) could not be received, "
      "at the limit RLIMIT_NOFILE sets (",
      limit.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : absl::StrCat(limit.rlim_cur),
      " here; or the host's fs.file-max). Raise it (`ulimit -n`, LimitNOFILE= in a systemd unit, "
      "--ulimit nofile= for docker) or open fewer files and connections in the process"));
}

}  // namespace

absl::StatusOr<size_t> ReceiveSome(int fd, char* dst, size_t capacity, std::deque<int>* received_fds,
                                   bool nonblocking) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kDescriptorsPerReceive)];
  while (true) {
    iovec iov{dst, capacity};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | (nonblocking ? MSG_DONTWAIT : 0));
    if (got < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && nonblocking) return 0;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        timeval tv{};
        socklen_t size = sizeof(tv);
        getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, &size);
        return absl::DeadlineExceededError(absl::StrCat(
            "the peer sent nothing for ", absl::ToInt64Milliseconds(absl::DurationFromTimeval(tv)),
            " ms"));
      }
      return absl::UnavailableError(ErrnoMessage("receive failed", errno));
    }
    int passed[kDescriptorsPerReceive];
    size_t delivered = 0;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count && delivered < kDescriptorsPerReceive; ++i) {
        std::memcpy(&passed[delivered++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      }
    }
    const bool dropped = (msg.msg_flags & MSG_CTRUNC) != 0;
    for (size_t i = 0; i < delivered; ++i) {
      if (received_fds != nullptr && !dropped) {
        received_fds->push_back(passed[i]);
      } else {
        close(passed[i]);
      }
    }
    if (dropped) return DroppedDescriptors(delivered);
    if (got == 0) return absl::UnavailableError("the peer closed the connection");
    return static_cast<size_t>(got);
  }
}

absl::Status ReceiveExact(int fd, char* dst, size_t length, std::deque<int>* received_fds,
                          absl::Time deadline) {
  size_t done = 0;
  while (done < length) {
    if (deadline != absl::InfiniteFuture()) {
      // The receive timeout restarts with every byte; what is left of the deadline does not.
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("handshake timed out");
      absl::Status status = SetReceiveTimeout(fd, left);
      if (!status.ok()) return status;
    }
    absl::StatusOr<size_t> got = ReceiveSome(fd, dst + done, length - done, received_fds);
    if (!got.ok()) return got.status();
    done += *got;
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<wire::Frame> ReadFrameWith(absl::FunctionRef<absl::Status(char*, size_t)> read) {
  char header_bytes[wire::kHeaderLength];
  absl::Status status = read(header_bytes, sizeof(header_bytes));
  if (!status.ok()) return status;
  absl::StatusOr<wire::Header> header = wire::DecodeHeader({header_bytes, sizeof(header_bytes)});
  if (!header.ok()) return header.status();
  std::string body(header->body_length, '\0');
  status = read(body.data(), body.size());
  if (!status.ok()) return status;
  return wire::DecodeBody(header->type, body);
}

}  // namespace

absl::StatusOr<wire::Frame> ReceiveFrame(int fd, std::deque<int>* received_fds, absl::Time deadline) {
  return ReadFrameWith(
      [&](char* dst, size_t length) { return ReceiveExact(fd, dst, length, received_fds, deadline); });
}

StreamReader::StreamReader(int fd) : fd_(fd) {}

StreamReader::~StreamReader() {
  for (const auto& [position, fd] : descriptors_) close(fd);
}

absl::StatusOr<std::optional<wire::Frame>> StreamReader::NextFrame() {
  while (true) {
    const size_t unread = end_ - begin_;
    if (unread >= wire::kHeaderLength) {
      absl::StatusOr<wire::Header> header =
          wire::DecodeHeader({buffer_.get() + begin_, wire::kHeaderLength});
      if (!header.ok()) return header.status();
      const size_t frame_length = wire::kHeaderLength + header->body_length;
      if (unread >= frame_length) {
        absl::StatusOr<wire::Frame> frame = wire::DecodeBody(
            header->type, {buffer_.get() + begin_ + wire::kHeaderLength, header->body_length});
        begin_ += frame_length;
        consumed_ += frame_length;
        if (!frame.ok()) return frame.status();
        return std::optional<wire::Frame>(*std::move(frame));
      }
    }
    // A frame (header and bounded body) always fits: move its start to the buffer's, and receive.
    if (!buffer_) buffer_.reset(new char[kBufferBytes]);
    if (begin_ > 0) {
      std::memmove(buffer_.get(), buffer_.get() + begin_, unread);
      begin_ = 0;
      end_ = unread;
    }
    absl::StatusOr<size_t> got = Receive(buffer_.get() + end_, kBufferBytes - end_, false);
    if (!got.ok()) return got.status();
    if (*got == 0) return std::nullopt;
  }
}

absl::StatusOr<size_t> StreamReader::ReadSome(char* dst, size_t length) {
  if (begin_ == end_) {
    // What would take the buffer more than two fills lands in place, copied by the kernel only.
    if (length >= kBufferBytes / 2) return Receive(dst, length, true);
    if (!buffer_) buffer_.reset(new char[kBufferBytes]);
    begin_ = end_ = 0;
    absl::StatusOr<size_t> got = Receive(buffer_.get(), kBufferBytes, false);
    if (!got.ok() || *got == 0) return got;
  }
  const size_t n = std::min(length, end_ - begin_);
  std::memcpy(dst, buffer_.get() + begin_, n);
  begin_ += n;
  consumed_ += n;
  return n;
}

void StreamReader::ReleaseIfDrained() {
  if (begin_ != end_) return;
  begin_ = end_ = 0;
  buffer_.reset();
}

void StreamReader::Release() {
  begin_ = end_ = 0;
  buffer_.reset();
  for (const auto& [position, fd] : descriptors_) close(fd);
  descriptors_.clear();
}

absl::StatusOr<size_t> StreamReader::Receive(char* dst, size_t capacity, bool in_place) {
  if (socket_drained_) return 0;
  passed_.clear();
  absl::StatusOr<size_t> got = ReceiveSome(fd_, dst, capacity, &passed_, /*nonblocking=*/true);
  if (!got.ok()) {
    for (int fd : passed_) close(fd);
    return got.status();
  }
  socket_drained_ = *got < capacity;
  received_ += *got;
  // A receive that brings descriptors ends with the bytes of the send that passed them.
  for (int fd : passed_) descriptors_.emplace_back(received_, fd);
  if (in_place) {
    consumed_ += *got;
  } else {
    end_ += *got;
  }
  return *got;
}

std::vector<int> StreamReader::TakeDescriptors() {
  std::vector<int> taken;
  while (!descriptors_.empty() && descriptors_.front().first <= consumed_) {
    taken.push_back(descriptors_.front().second);
    descriptors_.pop_front();
  }
  return taken;
}

absl::Status SocketFrameChannel::Send(const wire::Frame& frame) {
  std::string bytes = wire::Encode(frame);
  return SendAll(fd_, {iovec{bytes.data(), bytes.size()}});
}

absl::StatusOr<wire::Frame> SocketFrameChannel::Receive(absl::Time deadline) {
  return ReceiveFrame(fd_, nullptr, deadline);
}

}  // namespace tf_rdma
