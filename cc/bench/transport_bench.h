// Throughput and latency of one backend between two processes, with the baselines that make the
// numbers mean something measured in the same run: a plain single-stream TCP socket between the
// same two processes, and a plain memcpy of the same size.
#ifndef TF_RDMA_CC_BENCH_TRANSPORT_BENCH_H_
#define TF_RDMA_CC_BENCH_TRANSPORT_BENCH_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/transport/transport.h"

namespace tf_rdma::bench {

struct BenchPlan {
  std::vector<uint64_t> sizes;       // throughput: message sizes in bytes
  std::vector<uint64_t> latency_sizes;
  uint64_t bytes_per_size = 1ull << 30;  // each throughput size moves about this much
  int latency_round_trips = 500;
  int depth = 4;                     // grants outstanding at once (pipelining)
};

struct SizeResult {
  uint64_t size = 0;
  uint64_t iterations = 0;
  double transport_gbps = 0;    // GB/s (1e9 bytes per second)
  double tcp_socket_gbps = 0;   // the same bytes over a plain TCP socket
  double memcpy_gbps = 0;       // one memcpy of the same size, same process
};

struct LatencyResult {
  uint64_t size = 0;
  double transport_us = 0;   // one-way: half the round trip
  double tcp_socket_us = 0;
  // The driving process's CPU time (all threads, user and system) over the wall time of its
  // transport round trips: 100 is one core kept busy. Polling for completions shows here.
  double transport_cpu_percent = 0;
};

struct BenchReport {
  std::vector<SizeResult> throughput;
  std::vector<LatencyResult> latency;
};

// The receiving process: listens for the transport on `host`:`port` (port 0: any) and for the TCP
// baseline on another port of the same host, tells `ready(transport_port, baseline_port)`, then
// serves one driver. verbs needs an address of the RDMA netdev as `host`, since rdma_cm picks the
// device by IP address.
absl::Status Serve(Backend backend, const TransportOptions& options, const BenchPlan& plan,
                   const std::string& host, uint16_t port,
                   const std::function<void(uint16_t, uint16_t)>& ready);

// The sending process.
absl::StatusOr<BenchReport> Drive(Backend backend, const TransportOptions& options,
                                  const BenchPlan& plan, const Endpoint& transport_endpoint,
                                  const Endpoint& baseline_endpoint);

}  // namespace tf_rdma::bench

#endif  // TF_RDMA_CC_BENCH_TRANSPORT_BENCH_H_
