// write_notify: how should the receiver of an RDMA WRITE learn that the data has landed?
//
// The verbs backend (cc/transport/verbs/) sends with RDMA WRITE_WITH_IMM: the receiver learns of
// each message from a receive completion and sleeps on the completion channel when idle. This
// tool measures that choice against the usual alternative, over one RC QP set up with librdmacm
// between two processes, for each message size (default 8 B, 4 KiB, 64 KiB, 1 MiB, 16 MiB):
//
//   imm+event  WRITE_WITH_IMM; the receiver waits for the receive completion through the
//              completion channel (ibv_req_notify_cq + ibv_get_cq_event), as the product does.
//   imm+poll   WRITE_WITH_IMM; the receiver busy-polls the CQ (ibv_poll_cq).
//   flag+poll  plain WRITE whose last 8 bytes are a sequence number; the receiver spins on that
//              word (volatile read). Caveat: the IB spec does not order the bytes of one WRITE, so
//              seeing the last word does not formally mean the rest has landed (it does on most
//              HCAs in practice: they place data in order). The immediate has no such assumption.
//
// For each it measures
//   latency    ping-pong, one-way latency = half the round trip (average, median, p99 of N);
//   throughput streaming, `--depth` (default 4) messages in flight into `--depth` receive slots.
//              The receiver returns credits (every depth/2 messages) with the same mechanism as
//              the mode under test: 8-byte WRITE_WITH_IMM for imm+*, 8-byte WRITE polled for flag.
// All this runs in `--rounds` rounds (default 3) with the modes interleaved, so that a busy host slows
// every mode alike, not the one that ran last. Latency: average, median and p99 of every iteration
// (Soft-RoCE under TCG has a heavy tail, so the median says more than the average). Throughput: the
// median round, with the min-max.
// The cpu% columns are the client's CPU time over wall time in each phase: what waiting costs.
// Every message is checked: the sequence number in the payload tail (and the immediate) must match.
//
// Build and run:  make bench-notify   (compiles into build/, and runs in the Soft-RoCE guest through
// tools/softroce/guest.py when this host has no RDMA device). By hand:
//   g++ -O2 -std=c++17 -o build/write_notify tools/bench/write_notify.cc -lrdmacm -libverbs
//   build/write_notify --ip 10.77.0.1 [--json]      # server and client in two processes (fork)
//   build/write_notify --server --ip A  /  build/write_notify --client --ip A   # two hosts
// Options: --port P, --sizes 8,4K,64K,1M,16M, --depth D, --scale F (multiplies iteration counts),
// --rounds R, --json. --ip defaults to $SOFTROCE_IP (set in the guest). Both ends must get the same options.
// Figures from the Soft-RoCE guest (TCG) only compare the modes with each other; they are not
// absolute performance figures.

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTimeoutSeconds = 120;  // no progress for this long: give up rather than hang
constexpr size_t kHeader = 4096;      // region: [credit word | credit source | ...][send slots][recv slots]
const char* g_role = "main";

[[noreturn]] void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "write_notify (%s): ", g_role);
  std::vfprintf(stderr, fmt, ap);
  std::fputc('\n', stderr);
  va_end(ap);
  std::exit(1);
}
// rdma_* and most ibv_* calls return -1/NULL and set errno; ibv_post_*/ibv_req_notify_cq return it.
void check_errno(bool ok, const char* call) { if (!ok) die("%s failed: %s", call, std::strerror(errno)); }
void check_rc(int rc, const char* call) { if (rc != 0) die("%s failed: %s", call, std::strerror(rc)); }

enum Mode { kImmEvent, kImmPoll, kFlagPoll };
const char* const kModeNames[] = {"imm+event", "imm+poll", "flag+poll"};

struct Options {
  enum { kBoth, kServer, kClient } role = kBoth;
  std::string ip;
  int port = 18771;
  std::vector<size_t> sizes = {8, 4 << 10, 64 << 10, 1 << 20, 16 << 20};
  int depth = 4;
  double scale = 1.0;
  int rounds = 3;
  bool json = false;
};

struct Wire {  // exchanged as rdma_cm private data
  uint64_t addr;
  uint32_t rkey;
  uint32_t depth;
  uint64_t max_size;
};

struct Spin {  // deadline for busy-wait loops
  uint64_t n = 0;
  Clock::time_point start = Clock::now();
  void tick(const char* what) {
    if ((++n & 0xffff) == 0 && Clock::now() - start > std::chrono::seconds(kTimeoutSeconds))
      die("timed out after %d s waiting for %s", kTimeoutSeconds, what);
  }
};

struct Conn {
  rdma_event_channel* ec = nullptr;
  rdma_cm_id* listen_id = nullptr;
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* send_cq = nullptr;
  ibv_cq* recv_cq = nullptr;
  ibv_mr* mr = nullptr;
  char* buf = nullptr;
  size_t bytes = 0, max_size = 0;
  int depth = 0, sq_cap = 0, rq_cap = 0, sq_outstanding = 0;
  bool armed = false;
  Wire peer{};
  uint64_t tx_seq = 0, rx_seq = 0, credit = 0;

  size_t send_off(int slot) const { return kHeader + size_t(slot) * max_size; }
  size_t recv_off(int slot) const { return kHeader + size_t(depth + slot) * max_size; }
};

rdma_cm_event* expect_event(rdma_event_channel* ec, rdma_cm_event_type want) {
  pollfd p{ec->fd, POLLIN, 0};
  int r = poll(&p, 1, kTimeoutSeconds * 1000);
  check_errno(r >= 0, "poll(rdma_cm event channel)");
  if (r == 0) die("timed out waiting for %s", rdma_event_str(want));
  rdma_cm_event* ev = nullptr;
  check_errno(rdma_get_cm_event(ec, &ev) == 0, "rdma_get_cm_event");
  if (ev->event != want)
    die("expected %s, got %s (status %d)", rdma_event_str(want), rdma_event_str(ev->event), ev->status);
  return ev;
}

Wire peer_wire(const rdma_cm_event* ev, const Conn& c) {
  Wire w{};
  if (ev->param.conn.private_data_len < sizeof w) die("peer sent %u bytes of private data", ev->param.conn.private_data_len);
  std::memcpy(&w, ev->param.conn.private_data, sizeof w);
  if (w.depth != uint32_t(c.depth) || w.max_size != c.max_size)
    die("peer runs with depth %u, max size %llu; give both ends the same --depth and --sizes", w.depth,
        (unsigned long long)w.max_size);
  return w;
}

void post_recv(Conn& c) {  // WRITE_WITH_IMM consumes a receive but places no data through it
  ibv_recv_wr wr{}, *bad = nullptr;
  check_rc(ibv_post_recv(c.id->qp, &wr, &bad), "ibv_post_recv");
}

void create_resources(Conn& c, rdma_cm_id* id) {
  c.id = id;
  c.sq_cap = 4 * c.depth + 16;
  c.rq_cap = 4 * c.depth + 16;
  check_errno((c.pd = ibv_alloc_pd(id->verbs)) != nullptr, "ibv_alloc_pd");
  check_errno((c.channel = ibv_create_comp_channel(id->verbs)) != nullptr, "ibv_create_comp_channel");
  check_errno((c.send_cq = ibv_create_cq(id->verbs, c.sq_cap, nullptr, nullptr, 0)) != nullptr, "ibv_create_cq(send)");
  check_errno((c.recv_cq = ibv_create_cq(id->verbs, c.rq_cap, nullptr, c.channel, 0)) != nullptr, "ibv_create_cq(recv)");
  ibv_qp_init_attr qa{};
  qa.send_cq = c.send_cq;
  qa.recv_cq = c.recv_cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = c.sq_cap;
  qa.cap.max_recv_wr = c.rq_cap;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = 16;  // the 8-byte credits go inline
  check_errno(rdma_create_qp(id, c.pd, &qa) == 0, "rdma_create_qp");
  c.bytes = kHeader + 2 * size_t(c.depth) * c.max_size;
  check_errno((c.buf = static_cast<char*>(std::aligned_alloc(4096, c.bytes))) != nullptr, "aligned_alloc");
  std::memset(c.buf, 0, c.bytes);
  std::memset(c.buf + c.send_off(0), 0xa5, size_t(c.depth) * c.max_size);  // payload pattern, never a seq
  check_errno((c.mr = ibv_reg_mr(c.pd, c.buf, c.bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)) != nullptr,
              "ibv_reg_mr");
  for (int i = 0; i < c.rq_cap; ++i) post_recv(c);
}

rdma_conn_param conn_param(const Wire& mine) {
  rdma_conn_param p{};
  p.private_data = &mine;
  p.private_data_len = sizeof mine;
  p.retry_count = 7;
  p.rnr_retry_count = 7;
  return p;
}

sockaddr_in address(const Options& o) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(o.port));
  if (inet_pton(AF_INET, o.ip.c_str(), &a.sin_addr) != 1) die("--ip %s is not an IPv4 address", o.ip.c_str());
  return a;
}

void listen_on(Conn& c, const Options& o) {
  check_errno((c.ec = rdma_create_event_channel()) != nullptr, "rdma_create_event_channel");
  check_errno(rdma_create_id(c.ec, &c.listen_id, nullptr, RDMA_PS_TCP) == 0, "rdma_create_id");
  sockaddr_in a = address(o);
  check_errno(rdma_bind_addr(c.listen_id, reinterpret_cast<sockaddr*>(&a)) == 0, "rdma_bind_addr");
  check_errno(rdma_listen(c.listen_id, 1) == 0, "rdma_listen");
}

void accept_one(Conn& c) {
  rdma_cm_event* ev = expect_event(c.ec, RDMA_CM_EVENT_CONNECT_REQUEST);
  rdma_cm_id* id = ev->id;
  c.peer = peer_wire(ev, c);
  rdma_ack_cm_event(ev);
  create_resources(c, id);
  Wire mine{reinterpret_cast<uintptr_t>(c.buf), c.mr->rkey, uint32_t(c.depth), c.max_size};
  rdma_conn_param p = conn_param(mine);
  check_errno(rdma_accept(id, &p) == 0, "rdma_accept");
  rdma_ack_cm_event(expect_event(c.ec, RDMA_CM_EVENT_ESTABLISHED));
}

void connect_to(Conn& c, const Options& o) {
  check_errno((c.ec = rdma_create_event_channel()) != nullptr, "rdma_create_event_channel");
  rdma_cm_id* id = nullptr;
  check_errno(rdma_create_id(c.ec, &id, nullptr, RDMA_PS_TCP) == 0, "rdma_create_id");
  sockaddr_in a = address(o);
  check_errno(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&a), 2000) == 0, "rdma_resolve_addr");
  rdma_ack_cm_event(expect_event(c.ec, RDMA_CM_EVENT_ADDR_RESOLVED));
  check_errno(rdma_resolve_route(id, 2000) == 0, "rdma_resolve_route");
  rdma_ack_cm_event(expect_event(c.ec, RDMA_CM_EVENT_ROUTE_RESOLVED));
  create_resources(c, id);
  Wire mine{reinterpret_cast<uintptr_t>(c.buf), c.mr->rkey, uint32_t(c.depth), c.max_size};
  rdma_conn_param p = conn_param(mine);
  check_errno(rdma_connect(id, &p) == 0, "rdma_connect");
  rdma_cm_event* ev = expect_event(c.ec, RDMA_CM_EVENT_ESTABLISHED);
  c.peer = peer_wire(ev, c);  // the server's rdma_accept private data
  rdma_ack_cm_event(ev);
}

// Reaps send completions; with `need_room`, spins until the send queue has a free entry.
void reap_sends(Conn& c, bool need_room) {
  ibv_wc wc[16];
  for (Spin s;; s.tick("send completions")) {
    int n = ibv_poll_cq(c.send_cq, 16, wc);
    if (n < 0) die("ibv_poll_cq(send) failed");
    for (int i = 0; i < n; ++i)
      if (wc[i].status != IBV_WC_SUCCESS) die("send completion: %s", ibv_wc_status_str(wc[i].status));
    c.sq_outstanding -= n;
    if (n == 0 && (!need_room || c.sq_outstanding < c.sq_cap)) return;
  }
}

void drain_sends(Conn& c) {
  for (Spin s; c.sq_outstanding > 0; s.tick("the last send completions")) reap_sends(c, false);
}

void post_write(Conn& c, size_t local_off, uint32_t len, uint64_t remote_off, bool imm, uint32_t imm_value,
                bool inline_data) {
  reap_sends(c, true);
  ibv_sge sge{reinterpret_cast<uintptr_t>(c.buf + local_off), len, c.mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED | (inline_data ? IBV_SEND_INLINE : 0);
  wr.imm_data = htonl(imm_value);
  wr.wr.rdma.remote_addr = c.peer.addr + remote_off;
  wr.wr.rdma.rkey = c.peer.rkey;
  check_rc(ibv_post_send(c.id->qp, &wr, &bad), "ibv_post_send");
  ++c.sq_outstanding;
}

// Waits for one receive completion (a WRITE_WITH_IMM landed) and returns its immediate.
uint32_t wait_imm(Conn& c, bool events) {
  ibv_wc wc;
  for (Spin s;;) {
    int n = ibv_poll_cq(c.recv_cq, 1, &wc);
    if (n < 0) die("ibv_poll_cq(recv) failed");
    if (n == 1) {
      if (wc.status != IBV_WC_SUCCESS) die("receive completion: %s", ibv_wc_status_str(wc.status));
      if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM) die("unexpected receive completion opcode %d", wc.opcode);
      post_recv(c);
      return ntohl(wc.imm_data);
    }
    if (!events) { s.tick("a receive completion"); continue; }
    if (!c.armed) {  // arm, then poll once more: a completion may have come in between
      check_rc(ibv_req_notify_cq(c.recv_cq, 0), "ibv_req_notify_cq");
      c.armed = true;
      continue;
    }
    pollfd p{c.channel->fd, POLLIN, 0};
    int r = poll(&p, 1, kTimeoutSeconds * 1000);
    check_errno(r >= 0, "poll(completion channel)");
    if (r == 0) die("timed out after %d s waiting for a completion event", kTimeoutSeconds);
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    check_errno(ibv_get_cq_event(c.channel, &cq, &ctx) == 0, "ibv_get_cq_event");
    ibv_ack_cq_events(cq, 1);
    c.armed = false;
  }
}

uint64_t load(const char* p) { return *reinterpret_cast<const volatile uint64_t*>(p); }

// One message of `size` bytes into the peer's receive slot; its last 8 bytes are the sequence number.
void send_msg(Conn& c, Mode m, size_t size, int slot) {
  uint64_t seq = ++c.tx_seq;
  std::memcpy(c.buf + c.send_off(slot) + size - 8, &seq, 8);
  post_write(c, c.send_off(slot), uint32_t(size), c.recv_off(slot), m != kFlagPoll, uint32_t(seq), false);
}

void recv_msg(Conn& c, Mode m, size_t size, int slot) {
  uint64_t seq = ++c.rx_seq;
  const char* tail = c.buf + c.recv_off(slot) + size - 8;
  if (m == kFlagPoll) {
    for (Spin s; load(tail) < seq;) s.tick("the trailing sequence number");
    std::atomic_thread_fence(std::memory_order_acquire);
  } else {
    uint32_t imm = wait_imm(c, m == kImmEvent);
    if (imm != uint32_t(seq)) die("immediate %u, expected %llu", imm, (unsigned long long)seq);
  }
  if (load(tail) != seq) die("payload tail %llu, expected %llu", (unsigned long long)load(tail), (unsigned long long)seq);
}

// Credits: the receiver's count of messages consumed, written into the sender's header word 0.
void send_credit(Conn& c, Mode m) {
  std::memcpy(c.buf + 8, &c.rx_seq, 8);
  post_write(c, 8, 8, 0, m != kFlagPoll, uint32_t(c.rx_seq), true);
}

void wait_credit(Conn& c, Mode m, uint64_t want) {
  if (m == kFlagPoll) {
    for (Spin s; (c.credit = load(c.buf)) < want;) s.tick("a credit word");
  } else {
    while (c.credit < want) c.credit = wait_imm(c, m == kImmEvent);  // one completion per credit sent
  }
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double cpu_seconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return double(r.ru_utime.tv_sec + r.ru_stime.tv_sec) + 1e-6 * double(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

struct Phase { int count; double seconds, cpu; };

// Ping-pong through slot 0; the client sends first and appends each one-way time (RTT/2) to `one_way_us`.
Phase pingpong(Conn& c, Mode m, size_t size, int iters, bool client, std::vector<double>& one_way_us) {
  int warm = iters >= 10 ? std::min(20, iters / 10) : 0;
  Clock::time_point t0, t;
  double cpu0 = 0;
  for (int i = 0; i < warm + iters; ++i) {
    if (i == warm) { t0 = Clock::now(); cpu0 = cpu_seconds(); }
    if (i >= warm) t = Clock::now();
    if (client) { send_msg(c, m, size, 0); recv_msg(c, m, size, 0); }
    else { recv_msg(c, m, size, 0); send_msg(c, m, size, 0); }
    if (i >= warm && client) one_way_us.push_back(5e5 * seconds_since(t));
  }
  Phase p{iters, seconds_since(t0), cpu_seconds() - cpu0};
  drain_sends(c);
  return p;
}

// The client streams n messages, at most `depth` ahead of the server's credits.
Phase stream(Conn& c, Mode m, size_t size, int n, bool client) {
  const int every = std::max(1, c.depth / 2);
  Clock::time_point t0 = Clock::now();
  double cpu0 = cpu_seconds();
  if (client) {
    uint64_t first = c.tx_seq + 1;
    for (int k = 0; k < n; ++k) {
      if (k >= c.depth) wait_credit(c, m, first + k - c.depth);
      send_msg(c, m, size, k % c.depth);
    }
    wait_credit(c, m, c.tx_seq);
  } else {
    for (int k = 0; k < n; ++k) {
      recv_msg(c, m, size, k % c.depth);
      if ((k + 1) % every == 0 || k == n - 1) send_credit(c, m);
    }
  }
  Phase p{n, seconds_since(t0), cpu_seconds() - cpu0};
  drain_sends(c);
  return p;
}

// Counts per round (`--scale` multiplies them).
int latency_iters(size_t s) { return s <= 4096 ? 300 : s <= (64 << 10) ? 40 : s <= (1 << 20) ? 4 : 1; }
int stream_msgs(size_t s) { return s <= 4096 ? 1000 : s <= (64 << 10) ? 100 : s <= (1 << 20) ? 8 : 4; }
int scaled(int n, double f, int floor) { return std::max(floor, int(n * f)); }

struct Result {  // one (size, mode): per-round figures
  size_t size;
  Mode mode;
  std::vector<double> one_way_us, lat_cpu, mbps, msgs_per_s, bw_cpu;  // one_way_us: every iteration
  int lat_iters = 0, msgs = 0;
};

double quantile(std::vector<double> v, double q) {  // nearest rank
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}
double median(const std::vector<double>& v) { return quantile(v, 0.5); }
double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return sum / double(v.size());
}
double lowest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double highest(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

std::string size_name(size_t s) {
  if (s >= (1 << 20) && s % (1 << 20) == 0) return std::to_string(s >> 20) + " MiB";
  if (s >= 1024 && s % 1024 == 0) return std::to_string(s >> 10) + " KiB";
  return std::to_string(s) + " B";
}

void report(const Conn& c, const Options& o, const std::vector<Result>& results) {
  ibv_port_attr pa{};
  check_rc(ibv_query_port(c.id->verbs, c.id->port_num, &pa), "ibv_query_port");
  const char* dev = ibv_get_device_name(c.id->verbs->device);
  int mtu = 128 << pa.active_mtu;
  if (o.json) {
    std::printf("{\"device\": \"%s\", \"port\": %d, \"active_mtu\": %d, \"depth\": %d, \"rounds\": %d, \"rows\": [\n",
                dev, c.id->port_num, mtu, o.depth, o.rounds);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf("  {\"size\": %zu, \"mode\": \"%s\", \"latency_us_avg\": %.2f, \"latency_us_median\": %.2f, "
                  "\"latency_us_p99\": %.2f, \"latency_iters_per_round\": %d, \"latency_cpu\": %.3f, "
                  "\"throughput_MBps\": %.3f, \"throughput_MBps_min\": %.3f, \"throughput_MBps_max\": %.3f, "
                  "\"msgs_per_s\": %.1f, \"stream_msgs_per_round\": %d, \"stream_cpu\": %.3f}%s\n",
                  r.size, kModeNames[r.mode], mean(r.one_way_us), median(r.one_way_us), quantile(r.one_way_us, 0.99),
                  r.lat_iters,
                  median(r.lat_cpu), median(r.mbps), lowest(r.mbps), highest(r.mbps), median(r.msgs_per_s), r.msgs,
                  median(r.bw_cpu), i + 1 < results.size() ? "," : "");
    }
    std::printf("]}\n");
    return;
  }
  std::printf("write_notify: %s port %d, active MTU %d, RC, %d writes in flight when streaming, %d rounds\n", dev,
              c.id->port_num, mtu, o.depth, o.rounds);
  std::printf("%-8s %-10s %12s %12s %12s %5s %12s %-19s %9s %5s\n", "size", "mode", "avg us", "median us",
              "p99 us", "cpu%", "stream MB/s", " [min-max]", "msgs/s", "cpu%");
  for (const Result& r : results) {
    char bw_range[64];
    std::snprintf(bw_range, sizeof bw_range, " [%.2f-%.2f]", lowest(r.mbps), highest(r.mbps));
    std::printf("%-8s %-10s %12.1f %12.1f %12.1f %5.0f %12.3f %-19s %9.0f %5.0f\n", size_name(r.size).c_str(),
                kModeNames[r.mode], mean(r.one_way_us), median(r.one_way_us), quantile(r.one_way_us, 0.99),
                100 * median(r.lat_cpu), median(r.mbps), bw_range, median(r.msgs_per_s), 100 * median(r.bw_cpu));
  }
  std::printf("latency: one-way = half the ping-pong round trip, over every iteration of every round;\n"
              "stream: median round [min-max]; cpu%% = the client's CPU time / wall time (median round)\n");
}

void cleanup(Conn& c, bool client) {
  if (client) check_errno(rdma_disconnect(c.id) == 0, "rdma_disconnect");
  rdma_ack_cm_event(expect_event(c.ec, RDMA_CM_EVENT_DISCONNECTED));
  rdma_destroy_qp(c.id);
  check_rc(ibv_dereg_mr(c.mr), "ibv_dereg_mr");
  check_rc(ibv_destroy_cq(c.send_cq), "ibv_destroy_cq(send)");
  check_rc(ibv_destroy_cq(c.recv_cq), "ibv_destroy_cq(recv)");  // all events were acked in wait_imm
  check_rc(ibv_destroy_comp_channel(c.channel), "ibv_destroy_comp_channel");
  check_rc(ibv_dealloc_pd(c.pd), "ibv_dealloc_pd");
  check_errno(rdma_destroy_id(c.id) == 0, "rdma_destroy_id");
  if (c.listen_id) check_errno(rdma_destroy_id(c.listen_id) == 0, "rdma_destroy_id(listen)");
  rdma_destroy_event_channel(c.ec);
  std::free(c.buf);
}

// Both ends walk the same schedule: rounds x sizes x modes (the first mode rotates per round),
// each a ping-pong then a stream. Interleaving spreads a noisy host's slow spells over all modes.
void run(Conn& c, const Options& o, bool client) {
  std::vector<Result> results;
  for (size_t size : o.sizes)
    for (Mode m : {kImmEvent, kImmPoll, kFlagPoll}) results.push_back(Result{size, m, {}, {}, {}, {}, {}});
  for (int round = 0; round < o.rounds; ++round) {
    for (size_t si = 0; si < o.sizes.size(); ++si) {
      size_t size = o.sizes[si];
      for (int k = 0; k < 3; ++k) {
        Mode m = Mode((round + k) % 3);
        Result& r = results[si * 3 + m];
        r.lat_iters = scaled(latency_iters(size), o.scale, 1);
        r.msgs = scaled(stream_msgs(size), o.scale, o.depth);
        Phase lat = pingpong(c, m, size, r.lat_iters, client, r.one_way_us);
        Phase bw = stream(c, m, size, r.msgs, client);
        r.lat_cpu.push_back(lat.cpu / lat.seconds);
        r.mbps.push_back(double(size) * bw.count / bw.seconds / 1e6);
        r.msgs_per_s.push_back(bw.count / bw.seconds);
        r.bw_cpu.push_back(bw.cpu / bw.seconds);
      }
    }
    if (client && !o.json) std::fprintf(stderr, "  round %d of %d done\n", round + 1, o.rounds);
  }
  if (client) report(c, o, results);
  cleanup(c, client);
}

size_t parse_size(const std::string& s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  std::string unit = end;
  if (unit == "K" || unit == "k") v <<= 10;
  else if (unit == "M" || unit == "m") v <<= 20;
  else if (!unit.empty() || end == s.c_str()) die("bad size '%s' (e.g. 8, 4K, 16M)", s.c_str());
  if (v < 8 || v > (1ull << 30)) die("size %s out of range [8 B, 1 GiB]", s.c_str());
  return size_t(v);
}

Options parse(int argc, char** argv) {
  Options o;
  if (const char* ip = std::getenv("SOFTROCE_IP")) o.ip = ip;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("%s needs a value", a.c_str());
      return argv[++i];
    };
    if (a == "--server") o.role = Options::kServer;
    else if (a == "--client") o.role = Options::kClient;
    else if (a == "--ip") o.ip = value();
    else if (a == "--port") o.port = std::atoi(value().c_str());
    else if (a == "--depth") o.depth = std::atoi(value().c_str());
    else if (a == "--scale") o.scale = std::atof(value().c_str());
    else if (a == "--rounds") o.rounds = std::atoi(value().c_str());
    else if (a == "--json") o.json = true;
    else if (a == "--sizes") {
      o.sizes.clear();
      std::string list = value();
      for (size_t pos = 0; pos <= list.size();) {
        size_t comma = std::min(list.find(',', pos), list.size());
        o.sizes.push_back(parse_size(list.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else {
      die("unknown argument %s\nusage: write_notify [--server|--client] --ip ADDR [--port P] "
          "[--sizes 8,4K,64K,1M,16M] [--depth D] [--scale F] [--rounds R] [--json]", a.c_str());
    }
  }
  if (o.ip.empty()) die("give --ip (the address of the RDMA interface; in the Soft-RoCE guest $SOFTROCE_IP)");
  if (o.depth < 1 || o.depth > 64) die("--depth must be in [1, 64]");
  if (!(o.scale > 0)) die("--scale must be positive");
  if (o.rounds < 1) die("--rounds must be at least 1");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  Conn c;
  c.depth = o.depth;
  c.max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
  if (o.role == Options::kServer) {
    g_role = "server";
    listen_on(c, o);
    accept_one(c);
    run(c, o, false);
    return 0;
  }
  if (o.role == Options::kClient) {
    g_role = "client";
    connect_to(c, o);
    run(c, o, true);
    return 0;
  }
  // Both ends here: fork before any verbs call; the child serves and says when it listens.
  int ready[2];
  check_errno(pipe(ready) == 0, "pipe");
  std::fflush(nullptr);
  pid_t pid = fork();
  check_errno(pid >= 0, "fork");
  if (pid == 0) {
    g_role = "server";
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    close(ready[0]);
    listen_on(c, o);
    check_errno(write(ready[1], "1", 1) == 1, "write(ready pipe)");
    close(ready[1]);
    accept_one(c);
    run(c, o, false);
    std::_Exit(0);
  }
  g_role = "client";
  close(ready[1]);
  char byte;
  if (read(ready[0], &byte, 1) != 1) die("the server process exited before listening");
  close(ready[0]);
  connect_to(c, o);
  run(c, o, true);
  int status = 0;
  check_errno(waitpid(pid, &status, 0) == pid, "waitpid");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("the server process failed (status %d)", status);
  return 0;
}
