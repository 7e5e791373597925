#include "cc/transport/settings.h"

#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

constexpr char kSizeUnits[] = "KMGT";  // 2^10, 2^20, 2^30, 2^40
constexpr char kSizeGrammar[] =
    "a whole number of bytes, or with a binary unit: 64K or 64KiB, 1M or 1MiB, 1G or 1GiB, 1T or 1TiB";

// The power-of-two shift of a size's unit ("", "B", "K", "KB", "KI", "KIB", ..., upper case), or -1.
int UnitShift(std::string_view unit) {
  if (unit.empty() || unit == "B") return 0;
  const size_t prefix = std::string_view(kSizeUnits).find(unit.front());
  if (prefix == std::string_view::npos) return -1;
  unit.remove_prefix(1);
  if (unit.empty() || unit == "B" || unit == "I" || unit == "IB") return 10 * static_cast<int>(prefix + 1);
  return -1;
}

std::string Bound(const Setting& setting, int64_t bound) {
  return setting.kind == SettingKind::kBytes ? FormatSize(static_cast<uint64_t>(bound)) : absl::StrCat(bound);
}

}  // namespace

namespace settings {

const Setting kBackend{
    "TF_RDMA_BACKEND", SettingKind::kText, 0, 0, 0, "auto", nullptr, nullptr,
    "Transport for tensors between tasks: auto (shm for peers on this host, verbs where an RDMA "
    "device reaches the peer's address, else tcp), verbs, tcp or shm. An explicit backend that "
    "cannot work is an error."};
const Setting kPeerTimeoutMs{
    "TF_RDMA_PEER_TIMEOUT_MS", SettingKind::kMilliseconds, 30000, 100, 86400000, nullptr, nullptr,
    nullptr,
    "A peer silent this long (no data, no heartbeat) is declared dead and its pending transfers fail."};
const Setting kConnectTimeoutMs{
    "TF_RDMA_CONNECT_TIMEOUT_MS", SettingKind::kMilliseconds, 60000, 1, 86400000, nullptr, nullptr,
    nullptr,
    "How long connecting to a peer is retried (peers may start in any order) before failing."};
const Setting kPortOffset{
    "TF_RDMA_PORT_OFFSET", SettingKind::kCount, 1000, -65535, 65535, nullptr,
    "a non-zero whole number", nullptr,
    "Each task's tf_rdma listener port is its TensorFlow server port plus this (may be negative, "
    "not 0). Every task of a cluster must use the same value."};
const Setting kSecret{
    "TF_RDMA_SECRET", SettingKind::kText, 0, 0, 0, "(empty)", nullptr, nullptr,
    "Shared secret the cluster key is derived from: peers without it cannot connect or write. "
    "At least 16 random bytes in hex or base64, no pattern (make one with `python -m tf_rdma "
    "secret`; docs/security.md states the rule); empty: no secret, anyone who reaches a tf_rdma "
    "port can join."};
const Setting kSecretFile{
    "TF_RDMA_SECRET_FILE", SettingKind::kText, 0, 0, 0, "(unset)", nullptr, nullptr,
    "A regular file holding TF_RDMA_SECRET (e.g. a mounted Kubernetes Secret; trailing line "
    "breaks are ignored; a FIFO or device is refused). Setting both is an error."};
const Setting kVerbsDevice{
    "TF_RDMA_VERBS_DEVICE", SettingKind::kText, 0, 0, 0, "(auto)", nullptr, nullptr,
    "verbs: the RDMA device to use (a name from `ibv_devices`, e.g. mlx5_0). Default: the device "
    "whose port carries the peer's IP route, as rdma_cm resolves it."};
// 0 and -1 are what rdma_cm resolves (VerbsSettings), outside the range a value set must lie in.
const Setting kVerbsPort{
    "TF_RDMA_VERBS_PORT", SettingKind::kCount, 0, 1, 255, "(auto)", "a port number",
    "1 (ports count from 1, see `ibv_devinfo`)",
    "verbs: the device port to use (1-based, see `ibv_devinfo`). Default: the port rdma_cm resolves."};
const Setting kVerbsGidIndex{
    "TF_RDMA_VERBS_GID_INDEX", SettingKind::kCount, -1, 0, 65535, "(auto)", "a GID table index",
    "3 (see `show_gids` or `ibv_devinfo -v`)",
    "verbs: the source GID table index (see `show_gids`/`ibv_devinfo -v`). Default: the RoCE v2 "
    "GID of the local IP address, as rdma_cm resolves it."};
// 100 us halved 8-byte latency in the Soft-RoCE guest for a fifth of a core; longer windows gained
// little more there for a whole core (README, Performance).
const Setting kVerbsPollUs{
    "TF_RDMA_VERBS_POLL_US", SettingKind::kMicroseconds, 100, 0, 1000000, nullptr, nullptr,
    "100 (0 sleeps on completion events at once)",
    "verbs: microseconds the I/O thread serving a connection keeps polling for its completions "
    "after the last one before it sleeps on completion events (0: sleep at once). Polling "
    "lowers small-message latency and spends a core while it lasts."};
// Off by default: on a 2-core host it halved a ping-pong's latency but doubled TensorFlow's
// dependent hops, whose threads it took cores from.
const Setting kStreamPollUs{
    "TF_RDMA_STREAM_POLL_US", SettingKind::kMicroseconds, 0, 0, 1000000, nullptr, nullptr,
    "100 (0 sleeps at once)",
    "tcp and shm: microseconds an I/O thread keeps polling its connections after the last "
    "message before it sleeps (0: sleep at once). Polling lowers small-message latency (a "
    "thread's wake-up costs more than the message) but spends a core while it lasts, which "
    "slows TensorFlow's own threads on a host with few cores; a thread allowed on one core only "
    "does not poll."};
const Setting kIoThreads{
    "TF_RDMA_IO_THREADS", SettingKind::kCount, 2, 1, 64, nullptr, nullptr, nullptr,
    "Threads that serve all of a transport's connections (epoll loops), whatever the number of "
    "peers. More spread many busy peers over more cores."};
const Setting kMaxConcurrentHandshakes{
    "TF_RDMA_MAX_CONCURRENT_HANDSHAKES", SettingKind::kCount, 64, 1, 100000, nullptr, nullptr,
    nullptr,
    "Handshakes a listener runs at once (a thread and a descriptor each); clients beyond it are "
    "refused at once."};
const Setting kMaxGrantsPerPeer{
    "TF_RDMA_MAX_GRANTS_PER_PEER", SettingKind::kCount, 65536, 1, int64_t{1} << 32, nullptr,
    nullptr, nullptr,
    "Grants a peer may have outstanding here that no write used yet; more close its connection."};
// At most 64 TiB, half of x86-64's user address space: more could never be mapped.
const Setting kShmMaxMappedBytesPerPeer{
    "TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", SettingKind::kBytes, int64_t{64} << 30, 1,
    int64_t{64} << 40, nullptr, nullptr, nullptr,
    "shm: bytes of a peer's shared regions this process maps; more close its connection."};
const Setting kShmMaxMappedBytesTotal{
    "TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL", SettingKind::kBytes, int64_t{1} << 40, 1,
    int64_t{64} << 40, nullptr, nullptr, nullptr,
    "shm: bytes of all peers' shared regions this process maps together; a region past it "
    "closes the connection that shared it."};
const Setting kMaxConnectionsPerPeerName{
    "TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME", SettingKind::kCount, 16, 1, 100000, nullptr, nullptr,
    nullptr,
    "Live connections (per backend) with peers claiming one task name; more are refused."};
const Setting kReceivePoolIdleMs{
    "TF_RDMA_RECEIVE_POOL_IDLE_MS", SettingKind::kMilliseconds, 30000, 0, 86400000, nullptr,
    nullptr, nullptr,
    "A region of a peer's receive pool that held no received tensor or grant for this long is "
    "freed (on verbs, unpinned); 0 keeps regions for the connection's life."};
const Setting kDataPrefetchElements{
    "TF_RDMA_DATA_PREFETCH_ELEMENTS", SettingKind::kCount, 2, 0, 64, nullptr, nullptr, nullptr,
    "tf.data service: elements past the one being read that a trainer keeps receive buffers "
    "granted for, per worker task; each holds about one element's bytes."};
// At most 2 GiB: a protocol buffer, what every worker-service call carries, is no larger.
const Setting kMaxCallBytes{
    "TF_RDMA_MAX_CALL_BYTES", SettingKind::kBytes, int64_t{1} << 30, 64 << 10, int64_t{2} << 30,
    nullptr, nullptr, nullptr,
    "The largest request a peer's worker-service call may bring, what the requests one peer has in "
    "flight here may hold together, and the largest reply this task takes; a call past it fails with "
    "RESOURCE_EXHAUSTED naming this variable."};
const Setting kMaxCallsPerPeer{
    "TF_RDMA_MAX_CALLS_PER_PEER", SettingKind::kCount, 1024, 1, 1 << 20, nullptr, nullptr, nullptr,
    "Worker-service calls one peer may have in flight here at once; more fail with "
    "RESOURCE_EXHAUSTED naming this variable, and a peer that leaves as many such answers unread "
    "has its connection closed."};

// Every setting, in the order errors and `python -m tf_rdma info` list them.
const Setting* const kAll[] = {
    &kBackend, &kPeerTimeoutMs, &kConnectTimeoutMs, &kPortOffset, &kSecret, &kSecretFile,
    &kVerbsDevice, &kVerbsPort, &kVerbsGidIndex, &kVerbsPollUs, &kStreamPollUs, &kIoThreads,
    &kMaxConcurrentHandshakes, &kMaxGrantsPerPeer, &kShmMaxMappedBytesPerPeer,
    &kShmMaxMappedBytesTotal, &kMaxConnectionsPerPeerName, &kReceivePoolIdleMs,
    &kDataPrefetchElements, &kMaxCallBytes, &kMaxCallsPerPeer,
};
static_assert(sizeof(kAll) / sizeof(kAll[0]) == kSettingCount, "kSettingCount counts kAll's rows");

}  // namespace settings

const Setting* FindSetting(std::string_view name) {
  for (const Setting* setting : settings::kAll) {
    if (name == setting->name) return setting;
  }
  return nullptr;
}

const char* SettingUnit(const Setting& setting) {
  switch (setting.kind) {
    case SettingKind::kMilliseconds: return "ms";
    case SettingKind::kMicroseconds: return "us";
    case SettingKind::kBytes: return "bytes";
    case SettingKind::kText:
    case SettingKind::kCount: break;
  }
  return "";
}

std::string DefaultText(const Setting& setting) {
  if (setting.default_label != nullptr) return setting.default_label;
  return Bound(setting, setting.default_value);
}

absl::Status SettingValueError(const Setting& setting, const std::string& value) {
  const char* value_is = setting.value_is;
  if (value_is == nullptr) {
    switch (setting.kind) {
      case SettingKind::kMilliseconds: value_is = "a whole number of milliseconds"; break;
      case SettingKind::kMicroseconds: value_is = "a whole number of microseconds"; break;
      case SettingKind::kBytes: value_is = "a whole number of bytes"; break;
      case SettingKind::kText:
      case SettingKind::kCount: value_is = "a whole number"; break;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      setting.name, "='", value, "' is not ", value_is, " between ", Bound(setting, setting.minimum),
      " and ", Bound(setting, setting.maximum),
      setting.kind == SettingKind::kBytes ? " (units: K or KiB, M or MiB, G or GiB, T or TiB)" : "",
      "; set it to e.g. ", setting.example != nullptr ? setting.example : DefaultText(setting),
      " or unset it"));
}

absl::StatusOr<int64_t> ParseSettingValue(const Setting& setting, const std::string& value) {
  int64_t number = 0;
  bool parsed = false;
  if (setting.kind == SettingKind::kBytes) {
    const absl::StatusOr<uint64_t> size = ParseSize(value);
    parsed = size.ok() && *size <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (parsed) number = static_cast<int64_t>(*size);
  } else if (setting.kind != SettingKind::kText) {
    // Digits with an optional minus only: SimpleAtoi alone also takes "+5" and " 5 ".
    const std::string_view digits = absl::string_view(value).substr(!value.empty() && value[0] == '-');
    parsed = !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos &&
             absl::SimpleAtoi(value, &number);
  }
  if (!parsed || number < setting.minimum || number > setting.maximum) {
    return SettingValueError(setting, value);
  }
  return number;
}

absl::StatusOr<uint64_t> ParseSize(std::string_view text) {
  const std::string_view stripped = absl::StripAsciiWhitespace(text);
  const size_t digits = std::min(stripped.find_first_not_of("0123456789"), stripped.size());
  const std::string unit = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(stripped.substr(digits)));
  const int shift = UnitShift(unit);
  uint64_t number = 0;
  if (digits == 0 || shift < 0 || !absl::SimpleAtoi(stripped.substr(0, digits), &number)) {
    return absl::InvalidArgumentError(absl::StrCat("not a size: '", text, "' (", kSizeGrammar, ")"));
  }
  if (number > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("not a size: '", text, "' is more bytes than 64 bits count"));
  }
  return number << shift;
}

std::string FormatSize(uint64_t bytes) {
  for (int i = sizeof(kSizeUnits) - 2; i >= 0; --i) {
    const int shift = 10 * (i + 1);
    if (bytes != 0 && bytes % (uint64_t{1} << shift) == 0) {
      return absl::StrCat(bytes >> shift, " ", std::string(1, kSizeUnits[i]), "iB");
    }
  }
  return absl::StrCat(bytes, " B");
}

}  // namespace tf_rdma
