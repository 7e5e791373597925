#include "cc/bench/transport_bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tf_rdma::bench {
namespace {

using Clock = std::chrono::steady_clock;

double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Tag families; the low word numbers the message.
uint64_t DataTag(size_t size_index, int round) { return 1000 + 2 * size_index + round; }
uint64_t AckTag(size_t size_index, int round) { return 2000 + 2 * size_index + round; }
uint64_t PingTag(size_t index) { return 3000 + index; }
uint64_t PongTag(size_t index) { return 4000 + index; }

uint64_t Iterations(const BenchPlan& plan, uint64_t size) {
  const uint64_t n = plan.bytes_per_size / std::max<uint64_t>(size, 1);
  return std::clamp<uint64_t>(n, 8, 20000);
}

// Waits for a known number of completions and keeps the first error.
// Counts completions for a waiter. Only the completion it waits for (or an error) wakes it: a
// wake-up per message would put the waiting thread on the cores the transport's threads measure
// on, which the socket baseline does not pay.
class Completions {
 public:
  void Done(const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && error_.ok()) error_ = status;
    if (++done_ == wanted_ || !status.ok()) cv_.notify_all();
  }
  absl::Status WaitFor(uint64_t count) {
    std::unique_lock<std::mutex> lock(mu_);
    wanted_ = count;
    cv_.wait(lock, [&] { return done_ >= count || !error_.ok(); });
    return error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t done_ = 0;
  uint64_t wanted_ = 0;
  absl::Status error_;
};

absl::Status WriteAndWait(Connection& connection, const Tag& tag, const void* src, uint64_t length) {
  Completions written;
  connection.Write(tag, src, length, [&](const absl::Status& status) { written.Done(status); });
  return written.WaitFor(1);
}

// Receives n messages of `size`, keeping plan.depth grants outstanding in `region`'s slots.
absl::Status ReceiveRound(Connection& connection, std::shared_ptr<MemoryRegion> region,
                          uint64_t size, uint64_t n, uint64_t tag_hi, int depth) {
  Completions completions;
  std::mutex mu;
  uint64_t next = 0;
  std::function<void(uint64_t)> grant = [&](uint64_t i) {
    connection.Grant(Tag{tag_hi, i}, region, (i % depth) * size, size, [&, n](const GrantResult& r) {
      uint64_t following = n;
      if (r.status.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (next < n) following = next++;
      }
      // The slot is granted again before this completion counts, so the waiter cannot return
      // while this callback still uses the round's state.
      if (following < n) grant(following);
      completions.Done(r.status);
    });
  };
  {
    std::lock_guard<std::mutex> lock(mu);
    next = std::min<uint64_t>(depth, n);
  }
  for (uint64_t i = 0; i < std::min<uint64_t>(depth, n); ++i) grant(i);
  return completions.WaitFor(n);
}

// Bounces `rounds` messages of `size` between the two sides. Each landing message is answered from
// the thread that delivered it, as an event-driven application would, so no hand-off to another
// thread sits between two hops. `region` holds two landing slots and the outgoing message.
absl::Status Bounce(Connection& connection, const std::shared_ptr<MemoryRegion>& region,
                    uint64_t size, uint64_t rounds, uint64_t in_tag, uint64_t out_tag, bool starts) {
  Completions landed, written;
  const char* outgoing = region->data() + 2 * size;
  auto write = [&](uint64_t i) {
    connection.Write(Tag{out_tag, i}, outgoing, size, [&](const absl::Status& s) { written.Done(s); });
  };
  std::function<void(uint64_t)> grant = [&](uint64_t i) {
    connection.Grant(Tag{in_tag, i}, region, (i % 2) * size, size, [&, i](const GrantResult& r) {
      if (r.status.ok()) {
        if (i + 1 < rounds) grant(i + 1);
        const uint64_t next = starts ? i + 1 : i;
        if (next < rounds) write(next);
      }
      landed.Done(r.status);
    });
  };
  grant(0);
  if (starts) write(0);
  absl::Status status = landed.WaitFor(rounds);
  if (status.ok()) status = written.WaitFor(rounds);
  return status;
}

// ---- The plain TCP socket baseline ----

absl::StatusOr<int> ListenPlainTcp(const std::string& host, uint16_t* port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), &address.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("baseline listen: '", host, "' is not an IPv4 address"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), length) != 0 || listen(fd, 1) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("baseline listen: ", std::strerror(errno)));
  }
  *port = ntohs(address.sin_port);
  return fd;
}

absl::Status SendBytes(int fd, const char* data, uint64_t length) {
  while (length > 0) {
    const ssize_t n = send(fd, data, length, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("baseline send: ", std::strerror(errno)));
    data += n;
    length -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ReceiveBytes(int fd, char* data, uint64_t length) {
  while (length > 0) {
    const ssize_t n = recv(fd, data, length, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("baseline receive: connection lost");
    data += n;
    length -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::unique_ptr<char[]> TouchedBuffer(uint64_t size) {
  std::unique_ptr<char[]> buffer(new char[std::max<uint64_t>(size, 1)]);
  for (uint64_t i = 0; i < size; ++i) buffer[i] = static_cast<char>(i * 131);
  return buffer;
}

}  // namespace

absl::Status Serve(Backend backend, const TransportOptions& options, const BenchPlan& plan,
                   const std::string& host, uint16_t port,
                   const std::function<void(uint16_t, uint16_t)>& ready) {
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateTransport(backend, options);
  if (!transport.ok()) return transport.status();
  std::mutex mu;
  std::condition_variable accepted;
  std::shared_ptr<Connection> connection;
  absl::StatusOr<std::unique_ptr<Listener>> listener =
      (*transport)->Listen(Endpoint{host, port}, [&](std::shared_ptr<Connection> c) {
        std::lock_guard<std::mutex> lock(mu);
        if (!connection) connection = std::move(c);
        accepted.notify_all();
      }, /*admit=*/AdmitCallback());
  if (!listener.ok()) return listener.status();
  uint16_t baseline_port = 0;
  absl::StatusOr<int> baseline_listener = ListenPlainTcp(host, &baseline_port);
  if (!baseline_listener.ok()) return baseline_listener.status();
  ready((*listener)->endpoint().port, baseline_port);

  {
    std::unique_lock<std::mutex> lock(mu);
    if (!accepted.wait_for(lock, absl::ToChronoMilliseconds(options.connect_timeout),
                           [&] { return connection != nullptr; })) {
      close(*baseline_listener);
      return absl::DeadlineExceededError("no bench driver connected");
    }
  }
  const int baseline = accept4(*baseline_listener, nullptr, nullptr, SOCK_CLOEXEC);
  close(*baseline_listener);
  if (baseline < 0) return absl::UnavailableError("baseline accept failed");
  NoDelay(baseline);
  auto finish = [&](absl::Status status) {
    close(baseline);
    connection->Close(absl::CancelledError("bench done"));
    return status;
  };

  for (size_t s = 0; s < plan.sizes.size(); ++s) {
    const uint64_t size = plan.sizes[s];
    absl::StatusOr<std::shared_ptr<MemoryRegion>> region =
        (*transport)->AllocateRegion(size * plan.depth);
    if (!region.ok()) return finish(region.status());
    std::memset((*region)->data(), 0, (*region)->size());
    std::unique_ptr<char[]> sink = TouchedBuffer(size);
    for (int round = 0; round < 2; ++round) {
      const uint64_t n = round == 0 ? plan.depth : Iterations(plan, size);
      absl::Status status = ReceiveRound(*connection, *region, size, n, DataTag(s, round), plan.depth);
      if (status.ok()) status = WriteAndWait(*connection, Tag{AckTag(s, round), 0}, nullptr, 0);
      for (uint64_t i = 0; status.ok() && i < n; ++i) status = ReceiveBytes(baseline, sink.get(), size);
      const char ack = 1;
      if (status.ok()) status = SendBytes(baseline, &ack, 1);
      if (!status.ok()) return finish(status);
    }
  }
  for (size_t l = 0; l < plan.latency_sizes.size(); ++l) {
    const uint64_t size = plan.latency_sizes[l];
    absl::StatusOr<std::shared_ptr<MemoryRegion>> region = (*transport)->AllocateRegion(3 * size);
    if (!region.ok()) return finish(region.status());
    absl::Status bounced = Bounce(*connection, *region, size, plan.latency_round_trips, PingTag(l),
                                  PongTag(l), /*starts=*/false);
    if (!bounced.ok()) return finish(bounced);
    for (int i = 0; i < plan.latency_round_trips; ++i) {
      absl::Status status = ReceiveBytes(baseline, (*region)->data(), size);
      if (status.ok()) status = SendBytes(baseline, (*region)->data(), size);
      if (!status.ok()) return finish(status);
    }
  }
  return finish(absl::OkStatus());
}

absl::StatusOr<BenchReport> Drive(Backend backend, const TransportOptions& options,
                                  const BenchPlan& plan, const Endpoint& transport_endpoint,
                                  const Endpoint& baseline_endpoint) {
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateTransport(backend, options);
  if (!transport.ok()) return transport.status();
  absl::StatusOr<std::shared_ptr<Connection>> connection = (*transport)->Connect(transport_endpoint);
  if (!connection.ok()) return connection.status();
  Connection& conn = **connection;

  const int baseline = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(baseline_endpoint.port);
  inet_pton(AF_INET, baseline_endpoint.host.c_str(), &address.sin_addr);
  if (baseline < 0 || connect(baseline, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    if (baseline >= 0) close(baseline);
    return absl::UnavailableError(absl::StrCat("baseline connect: ", std::strerror(errno)));
  }
  NoDelay(baseline);
  auto fail = [&](absl::Status status) {
    close(baseline);
    conn.Close(absl::CancelledError("bench failed"));
    return status;
  };

  BenchReport report;
  // The latency bounce sends from `source` and receives into copy_targets[0] too.
  uint64_t largest = 1;
  for (uint64_t size : plan.sizes) largest = std::max(largest, size);
  for (uint64_t size : plan.latency_sizes) largest = std::max(largest, size);
  std::unique_ptr<char[]> source = TouchedBuffer(largest);
  // The memcpy baseline cycles through as many destinations as the transport keeps granted, so
  // both move the same working set through the caches.
  std::vector<std::unique_ptr<char[]>> copy_targets;
  for (int i = 0; i < plan.depth; ++i) copy_targets.push_back(TouchedBuffer(largest));
  absl::StatusOr<std::shared_ptr<MemoryRegion>> ack_region = (*transport)->AllocateRegion(64);
  if (!ack_region.ok()) return fail(ack_region.status());

  for (size_t s = 0; s < plan.sizes.size(); ++s) {
    const uint64_t size = plan.sizes[s];
    SizeResult result{size, Iterations(plan, size)};
    for (int round = 0; round < 2; ++round) {
      const uint64_t n = round == 0 ? plan.depth : result.iterations;
      Completions acked, written;
      const auto start = Clock::now();
      conn.Grant(Tag{AckTag(s, round), 0}, *ack_region, 0, 64,
                 [&](const GrantResult& r) { acked.Done(r.status); });
      for (uint64_t i = 0; i < n; ++i) {
        conn.Write(Tag{DataTag(s, round), i}, source.get(), size,
                   [&](const absl::Status& status) { written.Done(status); });
      }
      absl::Status status = acked.WaitFor(1);
      const double transport_seconds = Seconds(start);
      if (status.ok()) status = written.WaitFor(n);
      if (!status.ok()) return fail(status);

      const auto baseline_start = Clock::now();
      for (uint64_t i = 0; status.ok() && i < n; ++i) status = SendBytes(baseline, source.get(), size);
      char ack;
      if (status.ok()) status = ReceiveBytes(baseline, &ack, 1);
      if (!status.ok()) return fail(status);
      const double baseline_seconds = Seconds(baseline_start);

      const auto copy_start = Clock::now();
      for (uint64_t i = 0; i < n; ++i) {
        char* target = copy_targets[i % plan.depth].get();
        std::memcpy(target, source.get(), size);
        asm volatile("" : : "r"(target) : "memory");  // keep every copy
      }
      const double copy_seconds = Seconds(copy_start);
      if (round == 1) {
        const double bytes = static_cast<double>(n) * static_cast<double>(size);
        result.transport_gbps = bytes / transport_seconds / 1e9;
        result.tcp_socket_gbps = bytes / baseline_seconds / 1e9;
        result.memcpy_gbps = bytes / copy_seconds / 1e9;
      }
    }
    report.throughput.push_back(result);
  }
  for (size_t l = 0; l < plan.latency_sizes.size(); ++l) {
    const uint64_t size = plan.latency_sizes[l];
    absl::StatusOr<std::shared_ptr<MemoryRegion>> region = (*transport)->AllocateRegion(3 * size);
    if (!region.ok()) return fail(region.status());
    LatencyResult result{size};
    const double cpu_start = ProcessCpuSeconds();
    auto start = Clock::now();
    absl::Status bounced = Bounce(conn, *region, size, plan.latency_round_trips, PongTag(l),
                                  PingTag(l), /*starts=*/true);
    if (!bounced.ok()) return fail(bounced);
    const double bounce_seconds = Seconds(start);
    result.transport_cpu_percent = (ProcessCpuSeconds() - cpu_start) / bounce_seconds * 100;
    result.transport_us = bounce_seconds / plan.latency_round_trips / 2 * 1e6;
    start = Clock::now();
    for (int i = 0; i < plan.latency_round_trips; ++i) {
      absl::Status status = SendBytes(baseline, source.get(), size);
      if (status.ok()) status = ReceiveBytes(baseline, copy_targets[0].get(), size);
      if (!status.ok()) return fail(status);
    }
    result.tcp_socket_us = Seconds(start) / plan.latency_round_trips / 2 * 1e6;
    report.latency.push_back(result);
  }
  close(baseline);
  conn.Close(absl::CancelledError("bench done"));
  return report;
}

}  // namespace tf_rdma::bench
