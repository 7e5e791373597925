// The grant bookkeeping of one connection, the same whatever moves the bytes. Receiver side: the
// grants it issued that the peer has not answered yet. Sender side: the peer's grants not used
// yet and the writes waiting for one, paired by tag in arrival order; a grant too small for the
// write it meets goes back to the peer as TOO_SMALL. It also checks what a peer reports against
// what it was granted, so a buggy or hostile peer gets a DataLoss error, never a wrong write.
//
// Not thread-safe: each connection calls it under its own lock, and runs the callbacks it hands
// back after unlocking. `Write` is what the connection keeps of a write until it is paired; it
// must have `uint64_t length` and `WriteDone done`.
//
// A receiver whose step was cancelled discards its tags: the sender drops writes under them, now
// or when they come. A sender whose step was aborted or ended withdraws its tags:
// it drops its writes under them alike, and answers the receiver's grants under them, unused now
// or coming later, with WITHDRAWN and why, so that no receive waits for a message that will not
// come. Tags name one transfer each in tf_rdma's use, so the book remembers only the last
// kDiscardMemory discarded tags and, apart, the last kDiscardMemory withdrawn ones; a write later
// than that waits until the connection closes, and so does a grant under a withdrawn tag.
#ifndef TF_RDMA_CC_TRANSPORT_GRANT_BOOK_H_
#define TF_RDMA_CC_TRANSPORT_GRANT_BOOK_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cc/transport/transport.h"
#include "cc/transport/wire.h"

namespace tf_rdma {

// How a grant ends when the sender answered it with TOO_SMALL: its message needs more bytes.
inline GrantResult TooSmallResult(const wire::TooSmall& too_small) {
  return {absl::ResourceExhaustedError(
              absl::StrCat("the message needs ", too_small.needed, " bytes, more than granted")),
          too_small.needed};
}

// Whether [offset, offset + capacity) lies in `region`: what every Grant() checks first.
absl::Status CheckGrantRange(const MemoryRegion* region, uint64_t offset, uint64_t capacity);

struct IssuedGrant {
  Tag tag;
  std::shared_ptr<MemoryRegion> region;
  uint64_t offset;
  uint64_t capacity;
  GrantDone done;
  bool revoking = false;
};

constexpr size_t kDiscardMemory = 16384;

// The last kDiscardMemory tags remembered, each with a `Value`; the oldest is forgotten first.
template <typename Value>
class RecentTags {
 public:
  void Remember(const Tag& tag, Value value) {
    if (!values_.emplace(tag, std::move(value)).second) return;
    order_.push_back(tag);
    if (order_.size() > kDiscardMemory) {
      values_.erase(order_.front());
      order_.pop_front();
    }
  }
  const Value* Find(const Tag& tag) const {
    auto it = values_.find(tag);
    return it == values_.end() ? nullptr : &it->second;
  }

 private:
  std::unordered_map<Tag, Value, TagHash> values_;
  std::deque<Tag> order_;  // oldest first
};

template <typename Write>
class GrantBook {
 public:
  // Grant ids run from 1 to `max_id` and wrap, skipping ids still outstanding. The peer may have
  // at most `max_peer_grants` grants outstanding here unused (TransportLimits::max_grants_per_peer):
  // each costs memory until a write uses it, and nothing else bounds how many a peer sends.
  GrantBook(uint64_t max_id, size_t max_peer_grants)
      : max_id_(max_id), max_peer_grants_(max_peer_grants) {}

  // What the sender does next for a write or a grant that arrived.
  struct Pairing {
    std::optional<std::pair<wire::Grant, Write>> ready;  // write it into this grant
    std::vector<wire::TooSmall> too_small;               // tell the peer
    std::optional<Write> discarded;                      // complete it as cancelled
    std::vector<wire::Withdrawn> withdrawn;              // tell the peer: its grant's tag was withdrawn
  };
  // What the sender's withdrawing a tag lets go.
  struct Withdrawal {
    std::vector<Write> writes;               // complete them as cancelled
    std::vector<wire::Withdrawn> withdrawn;  // tell the peer: its grants under the tag
  };

  // ---- receiver side ----

  // Records a grant; returns its id.
  uint64_t Issue(const Tag& tag, std::shared_ptr<MemoryRegion> region, uint64_t offset,
                 uint64_t capacity, GrantDone done) {
    uint64_t id;
    do {
      id = next_id_;
      next_id_ = next_id_ == max_id_ ? 1 : next_id_ + 1;
    } while (issued_.count(id) != 0);
    issued_.emplace(id, IssuedGrant{tag, std::move(region), offset, capacity, std::move(done)});
    return id;
  }
  // Whether the peer is to be asked to give grant `id` back (outstanding, not asked yet).
  bool StartRevoke(uint64_t id) {
    auto it = issued_.find(id);
    if (it == issued_.end() || it->second.revoking) return false;
    it->second.revoking = true;
    return true;
  }
  // The peer wrote `length` bytes into grant `id`: the grant is done.
  absl::StatusOr<IssuedGrant> TakeFilled(uint64_t id, uint64_t length) {
    auto it = issued_.find(id);
    if (it == issued_.end()) {
      return absl::DataLossError(absl::StrCat("DATA for grant ", id, ", which is not outstanding"));
    }
    if (length > it->second.capacity) {
      return absl::DataLossError(
          absl::StrCat("DATA of ", length, " bytes for a grant of ", it->second.capacity));
    }
    return Take(it);
  }
  // The peer gave grant `id` back unused: TOO_SMALL (`needed` bytes, which must exceed the
  // grant) or REVOKED (no `needed`), which only a grant we asked back (StartRevoke) may get.
  absl::StatusOr<IssuedGrant> TakeReturned(uint64_t id, std::optional<uint64_t> needed) {
    auto it = issued_.find(id);
    if (it == issued_.end()) {
      return absl::DataLossError(absl::StrCat("grant ", id, " returned but not outstanding"));
    }
    if (needed && *needed <= it->second.capacity) {
      return absl::DataLossError(absl::StrCat("TOO_SMALL for a message of ", *needed,
                                              " bytes that fits the grant of ", it->second.capacity));
    }
    if (!needed && !it->second.revoking) {
      return absl::DataLossError(absl::StrCat("REVOKED for grant ", id, ", which was never revoked"));
    }
    return Take(it);
  }
  // The peer withdrew the message grant `id` waited for (WITHDRAWN): the grant is done. Any grant
  // still out may get it, one being revoked too (the peer withdrew it before the REVOKE came).
  absl::StatusOr<IssuedGrant> TakeWithdrawn(uint64_t id) {
    auto it = issued_.find(id);
    if (it == issued_.end()) {
      return absl::DataLossError(absl::StrCat("WITHDRAWN for grant ", id, ", which is not outstanding"));
    }
    return Take(it);
  }
  // Receiver side: takes back grant `id`, which the peer has not seen yet (verbs: its grant is not
  // written yet), so no REVOKE is needed.
  absl::StatusOr<IssuedGrant> TakeUnseen(uint64_t id) {
    auto it = issued_.find(id);
    if (it == issued_.end()) {
      return absl::InternalError(absl::StrCat("grant ", id, " taken back unseen but not outstanding"));
    }
    return Take(it);
  }
  // The connection failed: every grant still outstanding.
  std::vector<IssuedGrant> TakeAllIssued() {
    std::vector<IssuedGrant> all;
    for (auto& [id, grant] : issued_) all.push_back(std::move(grant));
    issued_.clear();
    return all;
  }

  // ---- sender side ----

  // The peer granted `grant`; pairs it with the oldest write waiting for its tag.
  absl::StatusOr<Pairing> OnPeerGrant(const wire::Grant& grant) {
    if (peer_grant_ids_.count(grant.grant_id) != 0) {
      return absl::DataLossError(absl::StrCat("grant id ", grant.grant_id, " granted twice"));
    }
    Pairing pairing;
    if (const absl::Status* why = withdrawn_.Find(grant.tag)) {
      // Nothing will ever be written under the tag: the receive learns it now, not never.
      pairing.withdrawn.push_back(WithdrawnAnswer(grant.grant_id, *why));
      return pairing;
    }
    auto writes = waiting_.find(grant.tag);
    if (writes == waiting_.end()) {
      if (peer_grant_ids_.size() >= max_peer_grants_) {
        return absl::DataLossError(absl::StrCat(
            "GRANT ", grant.grant_id, " would leave more than ", max_peer_grants_,
            " of the peer's grants unused here, the limit TF_RDMA_MAX_GRANTS_PER_PEER sets"));
      }
      peer_grant_ids_.insert(grant.grant_id);
      peer_grants_[grant.tag].push_back(grant);
      return pairing;
    }
    if (Pair(grant, writes->second.front(), &pairing)) {
      writes->second.pop_front();
      if (writes->second.empty()) waiting_.erase(writes);
    }
    return pairing;
  }
  // A write of `write.length` bytes under `tag`: paired with the first of the peer's grants for
  // the tag that fits (smaller ones go back as TOO_SMALL), or kept until one arrives.
  Pairing OnWrite(const Tag& tag, Write write) {
    Pairing pairing;
    if (discarded_.Find(tag) != nullptr || withdrawn_.Find(tag) != nullptr) {
      pairing.discarded.emplace(std::move(write));
      return pairing;
    }
    auto grants = peer_grants_.find(tag);
    while (grants != peer_grants_.end() && !pairing.ready) {
      const wire::Grant grant = grants->second.front();
      grants->second.pop_front();
      peer_grant_ids_.erase(grant.grant_id);
      if (grants->second.empty()) {
        peer_grants_.erase(grants);
        grants = peer_grants_.end();
      }
      Pair(grant, write, &pairing);
    }
    if (!pairing.ready) waiting_[tag].push_back(std::move(write));
    return pairing;
  }
  // Whether the peer's grant `id` was still unused, hence removed and to be answered REVOKED. A
  // used one is answered by its data or TOO_SMALL.
  bool OnPeerRevoke(uint64_t id) {
    if (peer_grant_ids_.erase(id) == 0) return false;
    for (auto it = peer_grants_.begin(); it != peer_grants_.end(); ++it) {
      auto& queue = it->second;
      for (auto grant = queue.begin(); grant != queue.end(); ++grant) {
        if (grant->grant_id != id) continue;
        queue.erase(grant);
        if (queue.empty()) peer_grants_.erase(it);
        return true;
      }
    }
    return true;
  }
  // Sender side: the peer discarded `tag` (DISCARD): the writes waiting under it, to complete as
  // cancelled, and those to come, dropped too. The peer's grants under it are its own to revoke.
  std::vector<Write> DiscardWrites(const Tag& tag) {
    discarded_.Remember(tag, true);
    return TakeWaiting(tag);
  }
  // Sender side: this process withdraws `tag` for `why` (its step was aborted or ended): its writes
  // are dropped as after DiscardWrites, and the peer's grants under it, unused now or to come, are
  // answered WITHDRAWN with `why` (an OK `why` reads as cancelled). `why` is kept as it is: the
  // copies a step's tags share hold one message between them.
  Withdrawal Withdraw(const Tag& tag, const absl::Status& why) {
    withdrawn_.Remember(tag, why.ok() ? absl::CancelledError("the sender withdrew the message") : why);
    const absl::Status& remembered = *withdrawn_.Find(tag);
    Withdrawal withdrawal;
    withdrawal.writes = TakeWaiting(tag);
    auto grants = peer_grants_.find(tag);
    if (grants == peer_grants_.end()) return withdrawal;
    for (const wire::Grant& grant : grants->second) {
      peer_grant_ids_.erase(grant.grant_id);
      withdrawal.withdrawn.push_back(WithdrawnAnswer(grant.grant_id, remembered));
    }
    peer_grants_.erase(grants);
    return withdrawal;
  }
  // The peer's unused grants are dropped, without allocating: what frees the memory a peer made
  // us hold when the process ran out of it, before its connection is failed.
  void ForgetPeerGrants() {
    peer_grants_.clear();
    peer_grant_ids_.clear();
  }
  // The connection failed: every write still waiting; the peer's grants are dropped.
  std::vector<Write> TakeAllWaiting() {
    std::vector<Write> all;
    for (auto& [tag, queue] : waiting_) {
      for (auto& write : queue) all.push_back(std::move(write));
    }
    waiting_.clear();
    peer_grants_.clear();
    peer_grant_ids_.clear();
    return all;
  }

 private:
  // Whether `write` fits `grant`; if so it moves into `pairing`, else the grant goes back.
  static bool Pair(const wire::Grant& grant, Write& write, Pairing* pairing) {
    if (grant.capacity < write.length) {
      pairing->too_small.push_back(wire::TooSmall{grant.grant_id, write.length});
      return false;
    }
    pairing->ready.emplace(grant, std::move(write));
    return true;
  }

  static wire::Withdrawn WithdrawnAnswer(uint64_t grant_id, const absl::Status& why) {
    return wire::Withdrawn{grant_id, static_cast<uint32_t>(why.code()),
                           std::string(why.message().substr(0, wire::kMaxWithdrawnReasonLength))};
  }

  std::vector<Write> TakeWaiting(const Tag& tag) {
    std::vector<Write> taken;
    auto writes = waiting_.find(tag);
    if (writes == waiting_.end()) return taken;
    for (auto& write : writes->second) taken.push_back(std::move(write));
    waiting_.erase(writes);
    return taken;
  }

  IssuedGrant Take(typename std::unordered_map<uint64_t, IssuedGrant>::iterator it) {
    IssuedGrant grant = std::move(it->second);
    issued_.erase(it);
    return grant;
  }

  const uint64_t max_id_;
  const size_t max_peer_grants_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, IssuedGrant> issued_;
  std::unordered_map<Tag, std::deque<Write>, TagHash> waiting_;
  std::unordered_map<Tag, std::deque<wire::Grant>, TagHash> peer_grants_;
  std::unordered_set<uint64_t> peer_grant_ids_;
  RecentTags<bool> discarded_;             // by the peer (DISCARD)
  RecentTags<absl::Status> withdrawn_;     // by this process (Withdraw), with why
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_GRANT_BOOK_H_
