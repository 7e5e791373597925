// Steady traffic over many connections at once, driven by the transport's own threads, for the
// scale bench and the fairness tests: how the bytes of hundreds of peers writing at once are
// shared out is the transport's doing, not the driving program's (Python would serialize it).
//
// The receiving side keeps `depth` grants of `size` bytes out on every connection and grants again
// from each grant's callback; the sending side keeps `depth` writes of `size` bytes waiting on
// every connection and writes again from each write's callback. Both count bytes per connection.
// Every grant of one connection covers the start of that connection's region (a bench needs the
// bytes to move, not to be kept). A region per connection, not one shared: a shm peer maps the
// regions it is granted, and one region shared by N connections would be mapped N times.
#ifndef TF_RDMA_CC_BENCH_STEADY_FLOW_H_
#define TF_RDMA_CC_BENCH_STEADY_FLOW_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cc/transport/transport.h"

namespace tf_rdma::bench {

// The tag every flow's grants and writes use.
constexpr Tag kSteadyFlowTag{0x5ca1e, 1};

class SteadyFlow {
 public:
  enum class Side { kReceive, kSend };
  // Starts the flow on every connection. Receiving: `regions` has one region of at least `size`
  // bytes per connection; sending: none.
  static absl::StatusOr<std::unique_ptr<SteadyFlow>> Start(
      Side side, std::vector<std::shared_ptr<Connection>> connections,
      std::vector<std::shared_ptr<MemoryRegion>> regions, uint64_t size, int depth);
  // Stops and waits for what is out (see Stop).
  ~SteadyFlow();

  // Bytes that landed (receiving) or went out (sending) so far, per connection.
  std::vector<uint64_t> Bytes() const;
  // Issues nothing more and waits up to `timeout` until what was out completed. Receiving: the
  // outstanding grants fill, so the senders must still be writing. Sending: the waiting writes are
  // withdrawn. Returns the first error any grant or write met (withdrawn writes are not errors).
  absl::Status Stop(absl::Duration timeout);

 private:
  struct State;
  explicit SteadyFlow(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace tf_rdma::bench

#endif  // TF_RDMA_CC_BENCH_STEADY_FLOW_H_
