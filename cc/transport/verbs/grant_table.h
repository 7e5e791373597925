// The grant-table slot protocol of one verbs connection (verbs_connection.h describes it): the
// table of ours the peer writes its grants into, and the slots of the peer's table our grants go
// to, from issue until the peer answers them.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_GRANT_TABLE_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_GRANT_TABLE_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/transport/verbs/registration_cache.h"
#include "cc/transport/verbs/verbs_messages.h"
#include "cc/transport/wire.h"

namespace tf_rdma::verbs {

// Counts of grants carried by writes into grant tables, for verbs_stats(): process-wide, TensorFlow's
// servers and the Python bindings alike, as both use the one transport library (setup.py).
struct GrantTableStats {
  uint64_t written = 0;  // grants this process wrote into a peer's table
  uint64_t read = 0;     // grants this process read from its own tables
};
GrantTableStats GetGrantTableStats();

// Not synchronised: its connection calls it under the connection's mutex, which guards it with the
// rest of the connection's state. Errors it returns are the peer's fault; the connection
// attributes them to the peer.
class GrantTables {
 public:
  // Slots of a grant table: grants outstanding towards the peer at once; more wait for a slot. A
  // slot frees only when the peer resolves its grant, so if an application sent the data of an
  // outstanding grant only after a waiting grant completed, neither would ever move. The table is
  // sized far above what is outstanding in practice (the TF runtime keeps two grants per pending
  // receive op, the bench four) so that no grant waits; it costs 256 KiB of registered memory per
  // connection.
  static constexpr uint32_t kSlots = 4096;
  static constexpr uint64_t kBytes = uint64_t{kSlots} * kGrantSlotSize;

  GrantTables() = default;
  ~GrantTables();  // deregisters our table, then unmaps it
  GrantTables(const GrantTables&) = delete;
  GrantTables& operator=(const GrantTables&) = delete;

  // Maps our table (pages of its own, holding nothing else: the only memory of ours the peer may
  // write without a grant) and registers it in `pd` with `access` (ibv_reg_mr(3)).
  absl::Status Allocate(ibv_pd* pd, int access);
  char* local() const { return local_; }
  const Registration& local_registration() const { return *local_registration_; }
  // Our table as the GRANT_TABLE message announces it, the peer writing through `rkey`.
  GrantTableMessage Announcement(uint32_t rkey) const;
  // The grant record the peer wrote into `slot` of our table, `length` bytes (the length its
  // WRITE_WITH_IMM's completion carries), checked as untrusted input.
  absl::StatusOr<wire::Grant> Read(uint32_t slot, uint32_t length);

  // The peer's GRANT_TABLE: where our grants go from now on.
  absl::Status OnPeerTable(const GrantTableMessage& table);
  // A grant issued to the peer, written once a slot of its table is free, in grant order.
  void Queue(const wire::Grant& grant) { unwritten_.push_back(grant); }
  // Takes back a grant the peer never saw; false if it was written already (or is unknown).
  bool Unqueue(uint64_t grant_id);
  // The next grant to write and the slot of the peer's table for it; none while the peer's table
  // is unknown or full, or no grant waits.
  struct SlotWrite {
    const wire::Grant& grant;
    uint32_t slot;
  };
  std::optional<SlotWrite> NextWrite() const;
  // The NextWrite() was posted: its slot holds that grant until the peer answers it.
  void Wrote();
  // Where the WRITE_WITH_IMM of a grant record into `slot` of the peer's table goes.
  uint64_t PeerSlotAddress(uint32_t slot) const { return peer_->address + uint64_t{slot} * kGrantSlotSize; }
  uint32_t peer_rkey() const { return peer_->rkey; }
  // Whether grant `grant_id` was written to the peer, which only then can answer it.
  bool IsWritten(uint64_t grant_id) const { return written_slots_.count(grant_id) != 0; }
  // The peer answered grant `grant_id` (written): it answers only after it read the grant's
  // record, so the slot may be written again and reuse needs no message of its own.
  void Release(uint64_t grant_id);
  // The connection failed: no grant is written any more.
  void DropUnwritten() { unwritten_.clear(); }
  // The queue pair stopped: no answer comes any more.
  void ForgetWritten() { written_slots_.clear(); }

 private:
  struct PeerTable {
    uint64_t address;
    uint32_t rkey;
  };

  char* local_ = nullptr;  // mmap'ed: registered memory gets pages of its own
  std::shared_ptr<Registration> local_registration_;
  std::optional<PeerTable> peer_;
  std::vector<uint32_t> free_peer_slots_;
  // Issued grants not written to the peer yet, in grant order: waiting for its grant table, a free
  // slot in it, a send buffer, or the control messages queued before them.
  std::deque<wire::Grant> unwritten_;
  std::unordered_map<uint64_t, uint32_t> written_slots_;  // grant id -> slot of the peer's table
};

}  // namespace tf_rdma::verbs

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_GRANT_TABLE_H_
