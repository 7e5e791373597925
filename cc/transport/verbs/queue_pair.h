// The verbs objects one connection is made of: its rdma_cm id and event channel, its reliable-
// connected queue pair with the completion queue and channel both of its queues report to, the
// buffers its control messages are sent from and received into, and the descriptors the
// connection's I/O loop watches. Created once, destroyed with the connection; what goes on the
// queues is the connection's business (verbs_connection.h).
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_QUEUE_PAIR_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_QUEUE_PAIR_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/transport/verbs/registration_cache.h"
#include "cc/transport/verbs/verbs_memory.h"
#include "cc/transport/verbs/verbs_messages.h"

namespace tf_rdma::verbs {

class QueuePair {
 public:
  static constexpr int kReceiveDepth = 128;  // receive buffers kept posted: control messages in flight
  static constexpr int kSendSlots = 64;      // control messages being sent at once
  static constexpr int kSendDepth = 256;     // send queue work requests
  static constexpr size_t kSlotSize = 4160;  // of a message buffer: >= kMaxMessageLength
  static_assert(kSlotSize >= kMaxMessageLength);

  // Takes ownership of `id` and `events` (its own event channel); Open() builds the rest.
  QueuePair(rdma_cm_id* id, rdma_event_channel* events) : id_(id), events_(events) {}
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;

  // Creates the queue pair on `device`, in RESET state, and everything it needs; `peer_address`
  // names the peer in errors.
  absl::Status Open(const DeviceContext& device, const std::string& peer_address);
  // Moves the queue pair to `state` (ibv_modify_qp(3)) with the attributes rdma_cm computed
  // (rdma_init_qp_attr(3)), and `gid_index` if >= 0 (TF_RDMA_VERBS_GID_INDEX).
  absl::Status Transition(ibv_qp_state state, int gid_index, const std::string& device_name);

  rdma_cm_id* id() const { return id_; }
  rdma_event_channel* events() const { return events_; }
  ibv_qp* qp() const { return qp_; }
  ibv_cq* cq() const { return cq_; }
  int completion_fd() const { return completion_channel_->fd; }
  // One descriptor for the loop to watch, readable when the completion channel, the rdma_cm event
  // channel or the wake-up eventfd is.
  int epoll_fd() const { return epoll_fd_; }
  // Takes the completion channel's event (ibv_get_cq_event(3), acknowledged) and requests the
  // next (ibv_req_notify_cq(3)); true if there was one.
  bool TakeCompletionEvent();
  // The PSN the queue pair expects next from the peer (ibv_query_qp(3)'s rq_psn): it moves with
  // every packet of the peer's that arrives in order, before any message completes.
  absl::StatusOr<uint32_t> NextReceivePsn() const;
  // Makes epoll_fd() readable: the loop then serves the connection.
  void Wake();
  // Consumes the wake-ups.
  void TakeWakes();

  char* receive_buffer(int slot) const { return receive_buffers_ + slot * kSlotSize; }
  char* send_buffer(int slot) const { return send_buffers_ + slot * kSlotSize; }
  uint32_t receive_lkey() const { return receive_registration_->lkey(); }
  uint32_t send_lkey() const { return send_registration_->lkey(); }

 private:
  rdma_cm_id* const id_;
  rdma_event_channel* const events_;
  ibv_comp_channel* completion_channel_ = nullptr;
  ibv_cq* cq_ = nullptr;  // both queues' completions
  ibv_qp* qp_ = nullptr;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  // mmap'ed: registered memory gets pages of its own. For this host's NIC only: no remote access.
  char* receive_buffers_ = nullptr;
  char* send_buffers_ = nullptr;
  std::shared_ptr<Registration> receive_registration_;
  std::shared_ptr<Registration> send_registration_;
};

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_QUEUE_PAIR_H_
