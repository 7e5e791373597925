// The grant book (cc/transport/grant_book.h) driven by a fuzzed sequence of what a peer sends
// (grants, revokes, TOO_SMALL, DATA, REVOKED, WITHDRAWN, DISCARD) interleaved with what this process
// does (writes, grants, revokes, giving tags up), checked against what the protocol promises:
// every write completes exactly once, every peer grant is answered at most once, a write goes only
// into a grant of its tag that holds it, the peer's unused grants stay within the limit, and the
// receiver side takes a grant back exactly when a reference model of the outstanding grants says.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>

#include "cc/transport/grant_book.h"

namespace {

using tf_rdma::Tag;

[[noreturn]] void Fail(const char* why) {
  __builtin_printf("grant_book_fuzz: %s\n", why);
  std::abort();
}

struct FuzzWrite {
  uint64_t length = 0;
  uint64_t id = 0;
};
using Book = tf_rdma::GrantBook<FuzzWrite>;

class FuzzRegion : public tf_rdma::MemoryRegion {
 public:
  explicit FuzzRegion(size_t size) : MemoryRegion(1, nullptr, size) {}
};

constexpr uint64_t kMaxIssuedId = 8;
constexpr size_t kMaxPeerGrants = 6;

struct PeerGrant {
  Tag tag;
  uint64_t capacity;
};
struct WriteRecord {
  Tag tag;
  uint64_t length;
};
struct IssuedRecord {
  uint64_t capacity;
  bool revoking = false;
};

class Harness {
 public:
  explicit Harness(FuzzedDataProvider& in) : in_(in), book_(kMaxIssuedId, kMaxPeerGrants) {}

  void Step() {
    switch (in_.ConsumeIntegralInRange<int>(0, 13)) {
      case 0: {  // the peer grants
        const tf_rdma::wire::Grant grant{in_.ConsumeIntegralInRange<uint64_t>(0, 15), SomeTag(), 1, 0, SomeLength()};
        const bool known = unused_.count(grant.grant_id) != 0;
        absl::StatusOr<Book::Pairing> pairing = book_.OnPeerGrant(grant);
        if (known && pairing.ok()) Fail("a grant id still unused was accepted again");
        if (!pairing.ok()) return;
        unused_[grant.grant_id] = PeerGrant{grant.tag, grant.capacity};
        Check(*pairing);
        break;
      }
      case 1: {  // this process writes
        const uint64_t id = next_write_++;
        const Tag tag = SomeTag();
        const uint64_t length = SomeLength();
        waiting_[id] = WriteRecord{tag, length};
        Check(book_.OnWrite(tag, FuzzWrite{length, id}));
        break;
      }
      case 2: {  // the peer revokes
        const uint64_t id = in_.ConsumeIntegralInRange<uint64_t>(0, 15);
        const bool unused = unused_.count(id) != 0;
        if (book_.OnPeerRevoke(id) != unused) Fail("REVOKED answered for a grant not unused, or not for an unused one");
        unused_.erase(id);
        break;
      }
      case 3:  // the peer discards a tag
        for (const FuzzWrite& write : book_.DiscardWrites(SomeTag())) Completed(write);
        break;
      case 4: {  // this process gives a tag up
        const Tag tag = SomeTag();
        Book::Withdrawal withdrawal = book_.Withdraw(tag, in_.ConsumeBool() ? absl::OkStatus() : absl::AbortedError("step aborted"));
        for (const FuzzWrite& write : withdrawal.writes) Completed(write);
        for (const tf_rdma::wire::Withdrawn& withdrawn : withdrawal.withdrawn) Answered(withdrawn.grant_id, &tag);
        break;
      }
      case 5:  // out of memory: the peer's unused grants go
        book_.ForgetPeerGrants();
        unused_.clear();
        break;
      case 6: {  // this process grants
        if (issued_.size() == kMaxIssuedId) return;  // every id is out: the owner must not ask
        const uint64_t capacity = SomeLength();
        const uint64_t id = book_.Issue(SomeTag(), std::make_shared<FuzzRegion>(capacity), 0, capacity, nullptr);
        if (id == 0 || id > kMaxIssuedId || !issued_.emplace(id, IssuedRecord{capacity}).second) {
          Fail("a grant got an id outside the range or one still outstanding");
        }
        break;
      }
      case 7: {  // this process revokes
        const uint64_t id = SomeIssuedId();
        auto it = issued_.find(id);
        const bool expected = it != issued_.end() && !it->second.revoking;
        if (book_.StartRevoke(id) != expected) Fail("StartRevoke disagrees with the outstanding grants");
        if (expected) it->second.revoking = true;
        break;
      }
      case 8: {  // the peer's DATA
        const uint64_t id = SomeIssuedId();
        const uint64_t length = SomeLength();
        auto it = issued_.find(id);
        Settle(id, book_.TakeFilled(id, length).ok(), it != issued_.end() && length <= it->second.capacity);
        break;
      }
      case 9: {  // the peer's TOO_SMALL
        const uint64_t id = SomeIssuedId();
        const uint64_t needed = SomeLength();
        auto it = issued_.find(id);
        Settle(id, book_.TakeReturned(id, needed).ok(), it != issued_.end() && needed > it->second.capacity);
        break;
      }
      case 10: {  // the peer's REVOKED
        const uint64_t id = SomeIssuedId();
        auto it = issued_.find(id);
        Settle(id, book_.TakeReturned(id, std::nullopt).ok(), it != issued_.end() && it->second.revoking);
        break;
      }
      case 11: {  // the peer's WITHDRAWN
        const uint64_t id = SomeIssuedId();
        Settle(id, book_.TakeWithdrawn(id).ok(), issued_.count(id) != 0);
        break;
      }
      case 12: {  // the connection fails
        if (book_.TakeAllIssued().size() != issued_.size()) Fail("TakeAllIssued missed outstanding grants");
        issued_.clear();
        for (const FuzzWrite& write : book_.TakeAllWaiting()) Completed(write);
        if (!waiting_.empty()) Fail("a write was neither completed nor handed back when the connection failed");
        unused_.clear();
        break;
      }
      case 13: {  // verbs: a grant taken back before the peer saw it
        const uint64_t id = SomeIssuedId();
        Settle(id, book_.TakeUnseen(id).ok(), issued_.count(id) != 0);
        break;
      }
    }
  }

  void Finish() {
    for (const FuzzWrite& write : book_.TakeAllWaiting()) Completed(write);
    if (!waiting_.empty()) Fail("a write was lost");
  }

 private:
  Tag SomeTag() { return Tag{in_.ConsumeIntegralInRange<uint64_t>(0, 2), 7}; }
  uint64_t SomeLength() { return in_.ConsumeIntegralInRange<uint64_t>(0, 64); }
  uint64_t SomeIssuedId() { return in_.ConsumeIntegralInRange<uint64_t>(0, kMaxIssuedId + 1); }

  void Settle(uint64_t id, bool taken, bool expected) {
    if (taken != expected) Fail("the receiver side took a grant back against the protocol, or refused a valid answer");
    if (taken) issued_.erase(id);
  }

  void Completed(const FuzzWrite& write) {
    if (waiting_.erase(write.id) != 1) Fail("a write completed twice, or one never made");
  }

  // The peer's grant `id` gets its answer (its tag must be `tag` when given).
  void Answered(uint64_t id, const Tag* tag) {
    auto it = unused_.find(id);
    if (it == unused_.end()) Fail("a peer grant was answered twice, or one never granted");
    if (tag != nullptr && !(it->second.tag == *tag)) Fail("a grant was answered for another tag");
    unused_.erase(it);
  }

  void Check(const Book::Pairing& pairing) {
    for (const tf_rdma::wire::TooSmall& too_small : pairing.too_small) {
      auto it = unused_.find(too_small.grant_id);
      if (it == unused_.end() || too_small.needed <= it->second.capacity) Fail("TOO_SMALL for a grant that fits");
      Answered(too_small.grant_id, nullptr);
    }
    for (const tf_rdma::wire::Withdrawn& withdrawn : pairing.withdrawn) {
      if (withdrawn.code == 0) Fail("WITHDRAWN with an OK code");
      Answered(withdrawn.grant_id, nullptr);
    }
    if (pairing.ready) {
      const auto& [grant, write] = *pairing.ready;
      auto record = waiting_.find(write.id);
      if (record == waiting_.end()) Fail("a write paired twice");
      if (!(record->second.tag == grant.tag) || record->second.length > grant.capacity) {
        Fail("a write paired with a grant of another tag or too small for it");
      }
      Answered(grant.grant_id, &grant.tag);
      Completed(write);
    }
    if (pairing.discarded) Completed(*pairing.discarded);
    if (unused_.size() > kMaxPeerGrants) Fail("the peer holds more unused grants than the limit");
  }

  FuzzedDataProvider& in_;
  Book book_;
  uint64_t next_write_ = 0;
  std::map<uint64_t, WriteRecord> waiting_;  // writes not completed, by id
  std::map<uint64_t, PeerGrant> unused_;     // the peer's grants not answered, by id
  std::map<uint64_t, IssuedRecord> issued_;  // this process's grants outstanding, by id
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Harness harness(in);
  while (in.remaining_bytes() > 0) harness.Step();
  harness.Finish();
  return 0;
}
