#include "cc/tf/calls/run_graph_ids.h"

#include <atomic>
#include <random>

namespace tf_rdma {
namespace {

// SplitMix64's finalizer: a bijection of 64-bit values, so distinct inputs give distinct ids.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t RandomBase() {
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

}  // namespace

int64_t NextRunGraphRequestId() {
  static const uint64_t base = RandomBase();
  static std::atomic<uint64_t> next{0};
  for (;;) {
    const uint64_t id = Mix(base + next.fetch_add(1, std::memory_order_relaxed));
    if (id != 0) return static_cast<int64_t>(id);
  }
}

WorkerWithOwnRunGraphIds::WorkerWithOwnRunGraphIds(tensorflow::WorkerInterface* worker)
    : worker_(worker), kind_([worker] {
        std::unique_ptr<tensorflow::MutableRunGraphRequestWrapper> sample(worker->CreateRunGraphRequest());
        if (dynamic_cast<tensorflow::InMemoryRunGraphRequest*>(sample.get()) != nullptr) return RequestKind::kInMemory;
        if (dynamic_cast<tensorflow::MutableProtoRunGraphRequest*>(sample.get()) != nullptr) return RequestKind::kProto;
        return RequestKind::kUnknown;
      }()) {}

tensorflow::MutableRunGraphRequestWrapper* WorkerWithOwnRunGraphIds::CreateRunGraphRequest() {
  switch (kind_) {
    case RequestKind::kInMemory:
      return new RunGraphRequestWithOwnId<tensorflow::InMemoryRunGraphRequest>;
    case RequestKind::kProto:
      return new RunGraphRequestWithOwnId<tensorflow::MutableProtoRunGraphRequest>;
    case RequestKind::kUnknown:
      break;
  }
  return worker_->CreateRunGraphRequest();
}

}  // namespace tf_rdma
