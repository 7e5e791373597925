// A peer's receive pool (cc/tf/runtime/buffer_pool.h) gives a region back only when no buffer of it
// is lent (so no grant into it is out) and it stayed so for the idle period, and works on after.
#include "cc/tf/runtime/buffer_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace tf_rdma {
namespace {

constexpr uint64_t kMiB = 1 << 20;

class HeapRegion : public MemoryRegion {
 public:
  HeapRegion(uint32_t id, size_t size) : MemoryRegion(id, new char[size], size) {}
  ~HeapRegion() override { delete[] data(); }
};

// Makes regions on the heap and remembers them, to tell which the pool still holds.
class RegionMaker : public Transport {
 public:
  Backend backend() const override { return Backend::kTcp; }
  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateRegion(size_t bytes) override {
    auto region = std::make_shared<HeapRegion>(static_cast<uint32_t>(made.size()), bytes);
    made.push_back(region);
    return region;
  }
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Endpoint&, AcceptCallback, AdmitCallback) override {
    return absl::UnimplementedError("not a transport");
  }
  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Endpoint&) override {
    return absl::UnimplementedError("not a transport");
  }
  bool Alive(size_t index) const { return !made.at(index).expired(); }

  std::vector<std::weak_ptr<MemoryRegion>> made;
};

constexpr absl::Duration kIdle = absl::Seconds(30);

TEST(BufferPool, ARegionGoesOnlyOnceNoBufferOfItIsLentAndItStayedIdleForThePeriod) {
  RegionMaker transport;
  auto pool = std::make_shared<BufferPool>(&transport, kMiB, 64 * kMiB);
  std::unique_ptr<PoolBuffer> first = *pool->Allocate(1000);
  std::unique_ptr<PoolBuffer> second = *pool->Allocate(1000);
  ASSERT_EQ(transport.made.size(), 1u);  // one slab holds both
  first.reset();
  pool->ReleaseIdle(absl::Now() + 10 * kIdle, kIdle);
  EXPECT_TRUE(transport.Alive(0)) << "a buffer of the region is still lent";
  second.reset();
  pool->ReleaseIdle(absl::Now(), kIdle);
  EXPECT_TRUE(transport.Alive(0)) << "the region was not idle for the period yet";
  EXPECT_EQ(pool->usage().region_bytes, kMiB);
  pool->ReleaseIdle(absl::Now() + 2 * kIdle, kIdle);
  EXPECT_FALSE(transport.Alive(0));
  EXPECT_EQ(pool->usage().region_bytes, 0u);

  // The next transfer gets a region again, of the smallest slab size: the pool grows from what it holds.
  std::unique_ptr<PoolBuffer> again = *pool->Allocate(1000);
  ASSERT_EQ(transport.made.size(), 2u);
  EXPECT_EQ(again->region()->size(), kMiB);
  EXPECT_EQ(pool->usage().region_bytes, kMiB);
}

TEST(BufferPool, ABufferLentWhileOtherRegionsGoKeepsItsOwnAndReturnsToIt) {
  RegionMaker transport;
  auto pool = std::make_shared<BufferPool>(&transport, kMiB, 64 * kMiB);
  std::unique_ptr<PoolBuffer> small = *pool->Allocate(1000);
  std::unique_ptr<PoolBuffer> large = *pool->Allocate(40 * kMiB);  // a region of its own
  ASSERT_EQ(transport.made.size(), 2u);
  small.reset();
  pool->ReleaseIdle(absl::Now() + 2 * kIdle, kIdle);
  EXPECT_FALSE(transport.Alive(0));
  ASSERT_TRUE(transport.Alive(1));
  std::fill(large->data(), large->data() + large->capacity(), 'x');
  const BufferPool::Usage lent = pool->usage();
  EXPECT_EQ(lent.region_bytes, 40 * kMiB);
  EXPECT_EQ(lent.buffers_in_use, 1u);
  EXPECT_EQ(lent.bytes_in_use, 40 * kMiB);
  large.reset();
  EXPECT_EQ(pool->usage().buffers_in_use, 0u);
  pool->ReleaseIdle(absl::Now() + 2 * kIdle, kIdle);
  EXPECT_FALSE(transport.Alive(1));
  EXPECT_EQ(pool->usage().region_bytes, 0u);
}

}  // namespace
}  // namespace tf_rdma
