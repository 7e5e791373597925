// The TF_RDMA_* settings: one row each (name, kind, default, range, doc), the one place their
// defaults and bounds are written. config.cc parses the environment by it, TransportOptions,
// TransportLimits, VerbsSettings and Config take their defaults from it, and the Python bindings
// expose it (tf_rdma.config.settings()) to `python -m tf_rdma info` and the README's check.
// Also the one grammar of sizes in bytes (ParseSize), for these settings and the CLI alike.
#ifndef TF_RDMA_CC_TRANSPORT_SETTINGS_H_
#define TF_RDMA_CC_TRANSPORT_SETTINGS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tf_rdma {

enum class SettingKind {
  kText,          // checked by config.cc by rules of its own (backend names, the secret's rule)
  kCount,         // a whole number
  kMilliseconds,  // a whole number of milliseconds
  kMicroseconds,  // a whole number of microseconds
  kBytes,         // a size, as ParseSize reads it
};

struct Setting {
  const char* name;
  SettingKind kind;
  // Numeric kinds: the value when the variable is unset, and the bounds a value set must lie in.
  int64_t default_value;
  int64_t minimum;
  int64_t maximum;
  // How the default reads where it is no number in the range: a text setting's default, or a
  // numeric one's that means "what rdma_cm resolves". Null: the default is default_value.
  const char* default_label;
  // What a value must be, for errors ("a port number"). Null: the kind's ("a whole number").
  const char* value_is;
  // The value an error suggests, with a word on it where needed. Null: the default.
  const char* example;
  const char* doc;

  constexpr absl::Duration default_duration() const {
    return kind == SettingKind::kMicroseconds ? absl::Microseconds(default_value)
                                              : absl::Milliseconds(default_value);
  }
};

namespace settings {

inline constexpr Setting kBackend{
    "TF_RDMA_BACKEND", SettingKind::kText, 0, 0, 0, "auto", nullptr, nullptr,
    "Transport for tensors between tasks: auto (shm for peers on this host, verbs where an RDMA "
    "device reaches the peer's address, else tcp), verbs, tcp or shm. An explicit backend that "
    "cannot work is an error."};
inline constexpr Setting kPeerTimeoutMs{
    "TF_RDMA_PEER_TIMEOUT_MS", SettingKind::kMilliseconds, 30000, 100, 86400000, nullptr, nullptr,
    nullptr,
    "A peer silent this long (no data, no heartbeat) is declared dead and its pending transfers fail."};
inline constexpr Setting kConnectTimeoutMs{
    "TF_RDMA_CONNECT_TIMEOUT_MS", SettingKind::kMilliseconds, 60000, 1, 86400000, nullptr, nullptr,
    nullptr,
    "How long connecting to a peer is retried (peers may start in any order) before failing."};
inline constexpr Setting kPortOffset{
    "TF_RDMA_PORT_OFFSET", SettingKind::kCount, 1000, -65535, 65535, nullptr,
    "a non-zero whole number", nullptr,
    "Each task's tf_rdma listener port is its TensorFlow server port plus this (may be negative, "
    "not 0). Every task of a cluster must use the same value."};
inline constexpr Setting kSecret{
    "TF_RDMA_SECRET", SettingKind::kText, 0, 0, 0, "(empty)", nullptr, nullptr,
    "Shared secret the cluster key is derived from: peers without it cannot connect or write. "
    "At least 16 random bytes in hex or base64, no pattern (make one with `python -m tf_rdma "
    "secret`; docs/security.md states the rule); empty: no secret, anyone who reaches a tf_rdma "
    "port can join."};
inline constexpr Setting kSecretFile{
    "TF_RDMA_SECRET_FILE", SettingKind::kText, 0, 0, 0, "(unset)", nullptr, nullptr,
    "A regular file holding TF_RDMA_SECRET (e.g. a mounted Kubernetes Secret; trailing line "
    "breaks are ignored; a FIFO or device is refused). Setting both is an error."};
inline constexpr Setting kVerbsDevice{
    "TF_RDMA_VERBS_DEVICE", SettingKind::kText, 0, 0, 0, "(auto)", nullptr, nullptr,
    "verbs: the RDMA device to use (a name from `ibv_devices`, e.g. mlx5_0). Default: the device "
    "whose port carries the peer's IP route, as rdma_cm resolves it."};
// 0 and -1 are what rdma_cm resolves (VerbsSettings), outside the range a value set must lie in.
inline constexpr Setting kVerbsPort{
    "TF_RDMA_VERBS_PORT", SettingKind::kCount, 0, 1, 255, "(auto)", "a port number",
    "1 (ports count from 1, see `ibv_devinfo`)",
    "verbs: the device port to use (1-based, see `ibv_devinfo`). Default: the port rdma_cm resolves."};
inline constexpr Setting kVerbsGidIndex{
    "TF_RDMA_VERBS_GID_INDEX", SettingKind::kCount, -1, 0, 65535, "(auto)", "a GID table index",
    "3 (see `show_gids` or `ibv_devinfo -v`)",
    "verbs: the source GID table index (see `show_gids`/`ibv_devinfo -v`). Default: the RoCE v2 "
    "GID of the local IP address, as rdma_cm resolves it."};
// 100 us halved 8-byte latency in the Soft-RoCE guest for a fifth of a core; longer windows gained
// little more there for a whole core (README, Performance).
inline constexpr Setting kVerbsPollUs{
    "TF_RDMA_VERBS_POLL_US", SettingKind::kMicroseconds, 100, 0, 1000000, nullptr, nullptr,
    "100 (0 sleeps on completion events at once)",
    "verbs: microseconds the I/O thread serving a connection keeps polling for its completions "
    "after the last one before it sleeps on completion events (0: sleep at once). Polling "
    "lowers small-message latency and spends a core while it lasts."};
// Off by default: on a 2-core host it halved a ping-pong's latency but doubled TensorFlow's
// dependent hops, whose threads it took cores from.
inline constexpr Setting kStreamPollUs{
    "TF_RDMA_STREAM_POLL_US", SettingKind::kMicroseconds, 0, 0, 1000000, nullptr, nullptr,
    "100 (0 sleeps at once)",
    "tcp and shm: microseconds an I/O thread keeps polling its connections after the last "
    "message before it sleeps (0: sleep at once). Polling lowers small-message latency (a "
    "thread's wake-up costs more than the message) but spends a core while it lasts, which "
    "slows TensorFlow's own threads on a host with few cores; a thread allowed on one core only "
    "does not poll."};
inline constexpr Setting kIoThreads{
    "TF_RDMA_IO_THREADS", SettingKind::kCount, 2, 1, 64, nullptr, nullptr, nullptr,
    "Threads that serve all of a transport's connections (epoll loops), whatever the number of "
    "peers. More spread many busy peers over more cores."};
inline constexpr Setting kMaxConcurrentHandshakes{
    "TF_RDMA_MAX_CONCURRENT_HANDSHAKES", SettingKind::kCount, 64, 1, 100000, nullptr, nullptr,
    nullptr,
    "Handshakes a listener runs at once (a thread and a descriptor each); clients beyond it are "
    "refused at once."};
inline constexpr Setting kMaxGrantsPerPeer{
    "TF_RDMA_MAX_GRANTS_PER_PEER", SettingKind::kCount, 65536, 1, int64_t{1} << 32, nullptr,
    nullptr, nullptr,
    "Grants a peer may have outstanding here that no write used yet; more close its connection."};
// At most 64 TiB, half of x86-64's user address space: more could never be mapped.
inline constexpr Setting kShmMaxMappedBytesPerPeer{
    "TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", SettingKind::kBytes, int64_t{64} << 30, 1,
    int64_t{64} << 40, nullptr, nullptr, nullptr,
    "shm: bytes of a peer's shared regions this process maps; more close its connection."};
inline constexpr Setting kShmMaxMappedBytesTotal{
    "TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL", SettingKind::kBytes, int64_t{1} << 40, 1,
    int64_t{64} << 40, nullptr, nullptr, nullptr,
    "shm: bytes of all peers' shared regions this process maps together; a region past it "
    "closes the connection that shared it."};
inline constexpr Setting kMaxConnectionsPerPeerName{
    "TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME", SettingKind::kCount, 16, 1, 100000, nullptr, nullptr,
    nullptr,
    "Live connections (per backend) with peers claiming one task name; more are refused."};
inline constexpr Setting kReceivePoolIdleMs{
    "TF_RDMA_RECEIVE_POOL_IDLE_MS", SettingKind::kMilliseconds, 30000, 0, 86400000, nullptr,
    nullptr, nullptr,
    "A region of a peer's receive pool that held no received tensor or grant for this long is "
    "freed (on verbs, unpinned); 0 keeps regions for the connection's life."};
inline constexpr Setting kDataPrefetchElements{
    "TF_RDMA_DATA_PREFETCH_ELEMENTS", SettingKind::kCount, 2, 0, 64, nullptr, nullptr, nullptr,
    "tf.data service: elements past the one being read that a trainer keeps receive buffers "
    "granted for, per worker task; each holds about one element's bytes."};

// Every setting, in the order errors and `python -m tf_rdma info` list them.
inline constexpr const Setting* kAll[] = {
    &kBackend, &kPeerTimeoutMs, &kConnectTimeoutMs, &kPortOffset, &kSecret, &kSecretFile,
    &kVerbsDevice, &kVerbsPort, &kVerbsGidIndex, &kVerbsPollUs, &kStreamPollUs, &kIoThreads,
    &kMaxConcurrentHandshakes, &kMaxGrantsPerPeer, &kShmMaxMappedBytesPerPeer,
    &kShmMaxMappedBytesTotal, &kMaxConnectionsPerPeerName, &kReceivePoolIdleMs,
    &kDataPrefetchElements,
};

}  // namespace settings

// The setting named `name`, or null.
const Setting* FindSetting(std::string_view name);

// The unit of a numeric setting's value ("ms", "us", "bytes"; "" for counts and text).
const char* SettingUnit(const Setting& setting);

// The default as the README and `info` state it: the label, else the number (a size for bytes).
std::string DefaultText(const Setting& setting);

// A numeric setting's value from `value` (the variable's text), in its unit, or an error naming
// the variable, the value, what it must be, its bounds and an example.
absl::StatusOr<int64_t> ParseSettingValue(const Setting& setting, const std::string& value);

// That error, for a value read but refused by a rule of the caller's (TF_RDMA_PORT_OFFSET's 0).
absl::Status SettingValueError(const Setting& setting, const std::string& value);

// A size in bytes: a whole number, optionally followed by a binary unit, K, M, G or T, each also
// written KiB/MiB/GiB/TiB, Ki/Mi/Gi/Ti or KB/MB/GB/TB (all powers of 1024), any case, with spaces
// allowed around the number and the unit: 4096, 64K, 64KiB, 1 GiB, 1T and 1TiB.
absl::StatusOr<uint64_t> ParseSize(std::string_view text);

// 1048576 -> "1 MiB": the largest binary unit that divides `bytes`, else "1536 B".
std::string FormatSize(uint64_t bytes);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_SETTINGS_H_
