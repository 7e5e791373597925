#include "cc/transport/verbs/queue_pair.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
namespace {

char* MapPages(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace

QueuePair::~QueuePair() {
  if (qp_ != nullptr) ibv_destroy_qp(qp_);
  if (cq_ != nullptr) ibv_destroy_cq(cq_);
  if (completion_channel_ != nullptr) ibv_destroy_comp_channel(completion_channel_);
  rdma_destroy_id(id_);
  rdma_destroy_event_channel(events_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  receive_registration_.reset();
  send_registration_.reset();
  if (receive_buffers_ != nullptr) munmap(receive_buffers_, kReceiveDepth * kSlotSize);
  if (send_buffers_ != nullptr) munmap(send_buffers_, kSendSlots * kSlotSize);
}

absl::Status QueuePair::Open(const DeviceContext& device, const std::string& peer_address) {
  ibv_context* context = device.context;
  const std::string where = absl::StrCat(" on RDMA device ", device.name, " for peer ", peer_address);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  completion_channel_ = ibv_create_comp_channel(context);
  if (wake_fd_ < 0 || completion_channel_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot create a completion channel", where, ": ",
                                                     std::strerror(errno)));
  }
  SetNonBlocking(completion_channel_->fd);
  SetNonBlocking(events_->fd);
  // The loop watches one descriptor per connection; this one stands for the three.
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot create an epoll descriptor", where, ": ",
                                                     std::strerror(errno)));
  }
  for (int fd : {completion_channel_->fd, events_->fd, wake_fd_}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot watch the connection's events", where,
                                                       ": epoll_ctl: ", std::strerror(errno)));
    }
  }
  cq_ = ibv_create_cq(context, kReceiveDepth + kSendDepth + 16, nullptr, completion_channel_, 0);
  if (cq_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot create a completion queue", where, ": ",
                                                     std::strerror(errno)));
  }
  ibv_req_notify_cq(cq_, 0);
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = kSendDepth;
  init.cap.max_recv_wr = kReceiveDepth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  qp_ = ibv_create_qp(device.pd, &init);
  if (qp_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot create a queue pair", where, ": ",
                                                     std::strerror(errno)));
  }
  receive_buffers_ = MapPages(kReceiveDepth * kSlotSize);
  send_buffers_ = MapPages(kSendSlots * kSlotSize);
  if (receive_buffers_ == nullptr || send_buffers_ == nullptr) {
    return absl::ResourceExhaustedError("cannot allocate message buffers");
  }
  auto receive = Registration::Create(device.pd, receive_buffers_, kReceiveDepth * kSlotSize,
                                      IBV_ACCESS_LOCAL_WRITE, "receive message buffers");
  if (!receive.ok()) return receive.status();
  receive_registration_ = *receive;
  auto send = Registration::Create(device.pd, send_buffers_, kSendSlots * kSlotSize, 0, "send message buffers");
  if (!send.ok()) return send.status();
  send_registration_ = *send;
  return absl::OkStatus();
}

absl::Status QueuePair::Transition(ibv_qp_state state, int gid_index, const std::string& device_name) {
  ibv_qp_attr attr{};
  int mask = 0;
  attr.qp_state = state;
  if (rdma_init_qp_attr(id_, &attr, &mask) != 0) {
    return absl::InternalError(absl::StrCat("rdma_init_qp_attr: ", std::strerror(errno)));
  }
  if (state == IBV_QPS_INIT) {
    // Peers only ever write into us; reads and atomics stay off.
    attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  }
  if (state == IBV_QPS_RTR && gid_index >= 0) {
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
  }
  if (ibv_modify_qp(qp_, &attr, mask) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot move the queue pair to ", state == IBV_QPS_INIT ? "INIT" : state == IBV_QPS_RTR ? "RTR" : "RTS",
        " (device ", device_name, " port ", static_cast<int>(id_->port_num), ", GID index ",
        gid_index >= 0 ? absl::StrCat(gid_index, " from TF_RDMA_VERBS_GID_INDEX")
                       : std::string("chosen by rdma_cm"),
        "): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

bool QueuePair::TakeCompletionEvent() {
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  if (ibv_get_cq_event(completion_channel_, &cq, &context) != 0) return false;
  ibv_ack_cq_events(cq, 1);
  ibv_req_notify_cq(cq_, 0);
  return true;
}

absl::StatusOr<uint32_t> QueuePair::NextReceivePsn() const {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  const int error = ibv_query_qp(qp_, &attr, IBV_QP_RQ_PSN, &init);
  if (error != 0) {
    return absl::UnavailableError(absl::StrCat("ibv_query_qp(IBV_QP_RQ_PSN): ", std::strerror(error)));
  }
  return attr.rq_psn;
}

void QueuePair::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

void QueuePair::TakeWakes() {
  uint64_t wakes;
  [[maybe_unused]] ssize_t n = read(wake_fd_, &wakes, sizeof(wakes));
}

}  // namespace tf_rdma::verbs
