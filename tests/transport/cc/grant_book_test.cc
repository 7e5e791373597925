// GrantBook: the receiver-granted protocol's bookkeeping, shared by every backend, as pure code
// (no sockets, no threads): pairing of grants and writes, bounds on what a peer makes us hold,
// and what the peer may not claim.
#include "cc/transport/grant_book.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>

namespace tf_rdma {
namespace {

struct FakeWrite {
  uint64_t length = 0;
  int id = 0;
};

class FakeRegion : public MemoryRegion {
 public:
  explicit FakeRegion(size_t size) : MemoryRegion(1, nullptr, size) {}
};

using Book = GrantBook<FakeWrite>;

wire::Grant PeerGrant(uint64_t id, Tag tag, uint64_t capacity) {
  return wire::Grant{id, tag, 1, 0, capacity};
}

TEST(GrantBookSender, AWriteWaitsForItsTagsGrantThenPairs) {
  Book book(1000, 16);
  const Tag tag{1, 2};
  Book::Pairing waiting = book.OnWrite(tag, FakeWrite{100, 7});
  EXPECT_FALSE(waiting.ready);
  absl::StatusOr<Book::Pairing> paired = book.OnPeerGrant(PeerGrant(5, tag, 128));
  ASSERT_TRUE(paired.ok()) << paired.status();
  ASSERT_TRUE(paired->ready);
  EXPECT_EQ(paired->ready->first.grant_id, 5u);
  EXPECT_EQ(paired->ready->second.id, 7);
}

TEST(GrantBookSender, GrantsAndWritesOfOneTagPairInFifoOrder) {
  Book book(1000, 16);
  const Tag tag{3, 4};
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(1, tag, 64)).ok());
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(2, tag, 64)).ok());
  EXPECT_EQ(book.OnWrite(tag, FakeWrite{10, 1}).ready->first.grant_id, 1u);
  EXPECT_EQ(book.OnWrite(tag, FakeWrite{10, 2}).ready->first.grant_id, 2u);
}

TEST(GrantBookSender, AGrantTooSmallGoesBackWithTheSizeNeededAndTheWriteKeepsWaiting) {
  Book book(1000, 16);
  const Tag tag{5, 6};
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(9, tag, 16)).ok());
  Book::Pairing pairing = book.OnWrite(tag, FakeWrite{100, 1});
  EXPECT_FALSE(pairing.ready);
  ASSERT_EQ(pairing.too_small.size(), 1u);
  EXPECT_EQ(pairing.too_small[0].grant_id, 9u);
  EXPECT_EQ(pairing.too_small[0].needed, 100u);
  EXPECT_TRUE(book.OnPeerGrant(PeerGrant(10, tag, 100))->ready);
}

TEST(GrantBookSender, APeerGrantIdUsedTwiceIsRefused) {
  Book book(1000, 16);
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(1, Tag{1, 1}, 8)).ok());
  absl::StatusOr<Book::Pairing> again = book.OnPeerGrant(PeerGrant(1, Tag{2, 2}, 8));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDataLoss);
}

TEST(GrantBookSender, UnusedPeerGrantsAreBoundedByTheLimitAndItsVariableIsNamed) {
  Book book(1000, 2);
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(1, Tag{1, 1}, 8)).ok());
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(2, Tag{1, 2}, 8)).ok());
  absl::StatusOr<Book::Pairing> third = book.OnPeerGrant(PeerGrant(3, Tag{1, 3}, 8));
  ASSERT_FALSE(third.ok());
  EXPECT_NE(third.status().message().find("TF_RDMA_MAX_GRANTS_PER_PEER"), absl::string_view::npos);
}

TEST(GrantBookSender, DiscardDropsTheWaitingWritesAndCancelsLaterOnes) {
  Book book(1000, 16);
  const Tag tag{7, 7};
  book.OnWrite(tag, FakeWrite{10, 1});
  std::vector<FakeWrite> dropped = book.DiscardWrites(tag);
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].id, 1);
  EXPECT_TRUE(book.OnWrite(tag, FakeWrite{10, 2}).discarded);
  EXPECT_FALSE(book.OnWrite(Tag{7, 8}, FakeWrite{10, 3}).discarded);
}

TEST(GrantBookSender, DiscardedTagsAreForgottenOldestFirstBeyondTheMemory) {
  Book book(1000, 16);
  for (uint64_t i = 0; i <= kDiscardMemory; ++i) book.DiscardWrites(Tag{0, i});
  EXPECT_FALSE(book.OnWrite(Tag{0, 0}, FakeWrite{1, 1}).discarded);
  EXPECT_TRUE(book.OnWrite(Tag{0, kDiscardMemory}, FakeWrite{1, 2}).discarded);
}

TEST(GrantBookSender, AGrantUnderADiscardedTagWaitsForItsReceiverToRevokeIt) {
  // The receiver discarded the tag itself: its grants are its own to take back.
  Book book(1000, 16);
  book.DiscardWrites(Tag{2, 2});
  absl::StatusOr<Book::Pairing> pairing = book.OnPeerGrant(PeerGrant(3, Tag{2, 2}, 8));
  ASSERT_TRUE(pairing.ok());
  EXPECT_TRUE(pairing->withdrawn.empty());
  EXPECT_TRUE(book.OnPeerRevoke(3));
}

TEST(GrantBookSender, AWithdrawnTagDropsItsWritesAndAnswersItsUnusedGrantsWithWhy) {
  Book book(1000, 16);
  const Tag tag{9, 9};
  book.OnWrite(tag, FakeWrite{100, 1});
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(4, tag, 10)).ok());  // too small: the write waits on
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(5, Tag{9, 10}, 10)).ok());
  Book::Withdrawal withdrawal = book.Withdraw(tag, absl::UnavailableError("peer ps:0 is unresponsive"));
  ASSERT_EQ(withdrawal.writes.size(), 1u);
  EXPECT_EQ(withdrawal.writes[0].id, 1);
  EXPECT_TRUE(withdrawal.withdrawn.empty());  // grant 4 went back as TOO_SMALL already
  // The receiver grants again, bigger: it learns the message will not come.
  absl::StatusOr<Book::Pairing> regrant = book.OnPeerGrant(PeerGrant(6, tag, 100));
  ASSERT_TRUE(regrant.ok());
  EXPECT_FALSE(regrant->ready);
  ASSERT_EQ(regrant->withdrawn.size(), 1u);
  EXPECT_EQ(regrant->withdrawn[0].grant_id, 6u);
  EXPECT_EQ(regrant->withdrawn[0].code, static_cast<uint32_t>(absl::StatusCode::kUnavailable));
  EXPECT_EQ(regrant->withdrawn[0].reason, "peer ps:0 is unresponsive");
  EXPECT_FALSE(book.OnPeerRevoke(6));  // answered, not kept
  EXPECT_TRUE(book.OnWrite(tag, FakeWrite{1, 2}).discarded);
  // Another tag's grant is untouched.
  EXPECT_TRUE(book.OnWrite(Tag{9, 10}, FakeWrite{10, 3}).ready);
}

TEST(GrantBookSender, AGrantWaitingUnderATagWhenItIsWithdrawnIsAnsweredAtOnce) {
  Book book(1000, 16);
  const Tag tag{8, 8};
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(1, tag, 10)).ok());
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(2, tag, 10)).ok());
  Book::Withdrawal withdrawal = book.Withdraw(tag, absl::OkStatus());
  EXPECT_TRUE(withdrawal.writes.empty());
  ASSERT_EQ(withdrawal.withdrawn.size(), 2u);
  EXPECT_EQ(withdrawal.withdrawn[0].grant_id, 1u);
  EXPECT_EQ(withdrawal.withdrawn[1].grant_id, 2u);
  // An OK reason reads as cancelled: a WITHDRAWN never carries OK.
  EXPECT_EQ(withdrawal.withdrawn[0].code, static_cast<uint32_t>(absl::StatusCode::kCancelled));
  // The grants are gone, so they count no more against the peer's limit and cannot be revoked.
  EXPECT_FALSE(book.OnPeerRevoke(1));
}

TEST(GrantBookSender, AWithdrawalsReasonIsCutToTheWiresBound) {
  Book book(1000, 16);
  book.Withdraw(Tag{1, 1}, absl::AbortedError(std::string(10000, 'r')));
  absl::StatusOr<Book::Pairing> pairing = book.OnPeerGrant(PeerGrant(1, Tag{1, 1}, 8));
  ASSERT_TRUE(pairing.ok());
  ASSERT_EQ(pairing->withdrawn.size(), 1u);
  EXPECT_EQ(pairing->withdrawn[0].reason.size(), wire::kMaxWithdrawnReasonLength);
}

TEST(GrantBookSender, WithdrawnTagsAreRememberedApartFromDiscardedOnesAndForgottenOldestFirst) {
  Book book(1000, 16);
  for (uint64_t i = 0; i <= kDiscardMemory; ++i) book.Withdraw(Tag{0, i}, absl::AbortedError("gone"));
  // As many discarded tags do not push the withdrawn ones out.
  for (uint64_t i = 0; i <= kDiscardMemory; ++i) book.DiscardWrites(Tag{1, i});
  absl::StatusOr<Book::Pairing> oldest = book.OnPeerGrant(PeerGrant(1, Tag{0, 0}, 8));
  ASSERT_TRUE(oldest.ok());
  EXPECT_TRUE(oldest->withdrawn.empty());
  absl::StatusOr<Book::Pairing> newest = book.OnPeerGrant(PeerGrant(2, Tag{0, kDiscardMemory}, 8));
  ASSERT_TRUE(newest.ok());
  EXPECT_EQ(newest->withdrawn.size(), 1u);
}

TEST(GrantBookSender, ARevokedUnusedGrantIsGivenBackOnceAndAUsedOneIsNot) {
  Book book(1000, 16);
  ASSERT_TRUE(book.OnPeerGrant(PeerGrant(4, Tag{1, 1}, 8)).ok());
  EXPECT_TRUE(book.OnPeerRevoke(4));
  EXPECT_FALSE(book.OnPeerRevoke(4));
  EXPECT_FALSE(book.OnWrite(Tag{1, 1}, FakeWrite{1, 1}).ready);
}

TEST(GrantBookReceiver, IdsWrapAndSkipTheOnesStillOutstanding) {
  Book book(3, 16);
  auto region = std::make_shared<FakeRegion>(64);
  EXPECT_EQ(book.Issue(Tag{1, 1}, region, 0, 8, nullptr), 1u);
  EXPECT_EQ(book.Issue(Tag{1, 2}, region, 8, 8, nullptr), 2u);
  ASSERT_TRUE(book.TakeFilled(1, 8).ok());
  EXPECT_EQ(book.Issue(Tag{1, 3}, region, 16, 8, nullptr), 3u);
  EXPECT_EQ(book.Issue(Tag{1, 4}, region, 24, 8, nullptr), 1u);  // 2 and 3 are still out
}

TEST(GrantBookReceiver, WhatAPeerMayNotClaimIsDataLoss) {
  Book book(1000, 16);
  auto region = std::make_shared<FakeRegion>(64);
  const uint64_t id = book.Issue(Tag{1, 1}, region, 0, 8, nullptr);
  EXPECT_EQ(book.TakeFilled(id, 9).status().code(), absl::StatusCode::kDataLoss);      // over capacity
  EXPECT_EQ(book.TakeFilled(id + 1, 1).status().code(), absl::StatusCode::kDataLoss);  // never issued
  EXPECT_EQ(book.TakeReturned(id, 8).status().code(), absl::StatusCode::kDataLoss);    // TOO_SMALL but fits
  EXPECT_EQ(book.TakeReturned(id, std::nullopt).status().code(),
            absl::StatusCode::kDataLoss);  // REVOKED, never revoked
  EXPECT_TRUE(book.StartRevoke(id));
  EXPECT_FALSE(book.StartRevoke(id));
  EXPECT_TRUE(book.TakeReturned(id, std::nullopt).ok());
}

TEST(GrantBookReceiver, AFailedConnectionHandsBackEveryOutstandingGrant) {
  Book book(1000, 16);
  auto region = std::make_shared<FakeRegion>(64);
  book.Issue(Tag{1, 1}, region, 0, 8, nullptr);
  book.Issue(Tag{1, 2}, region, 8, 8, nullptr);
  EXPECT_EQ(book.TakeAllIssued().size(), 2u);
  EXPECT_TRUE(book.TakeAllIssued().empty());
}

TEST(GrantRange, ARangeOutsideItsRegionIsRefused) {
  FakeRegion region(64);
  EXPECT_TRUE(CheckGrantRange(&region, 0, 64).ok());
  EXPECT_FALSE(CheckGrantRange(&region, 60, 8).ok());
  EXPECT_FALSE(CheckGrantRange(&region, UINT64_MAX, 2).ok());  // offset + capacity overflows
  EXPECT_FALSE(CheckGrantRange(nullptr, 0, 1).ok());
}

}  // namespace
}  // namespace tf_rdma
