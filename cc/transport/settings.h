// The TF_RDMA_* settings: one row each (name, kind, default, range, doc), the one place their
// defaults and bounds are written. config.cc parses the environment by it, TransportOptions,
// TransportLimits, VerbsSettings and Config take their defaults from it, and the Python bindings
// expose it (tf_rdma.config.settings()) to `python -m tf_rdma info` and the README's check.
// Also the one grammar of sizes in bytes (ParseSize), for these settings and the CLI alike.
#ifndef TF_RDMA_CC_TRANSPORT_SETTINGS_H_
#define TF_RDMA_CC_TRANSPORT_SETTINGS_H_

#include <cstddef>
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

// The rows, defined once in settings.cc (so that every library and extension reads the one copy in
// the transport library), in the order errors and `python -m tf_rdma info` list them.
extern const Setting kBackend;
extern const Setting kPeerTimeoutMs;
extern const Setting kConnectTimeoutMs;
extern const Setting kPortOffset;
extern const Setting kSecret;
extern const Setting kSecretFile;
extern const Setting kVerbsDevice;
extern const Setting kVerbsPort;
extern const Setting kVerbsGidIndex;
extern const Setting kVerbsPollUs;
extern const Setting kStreamPollUs;
extern const Setting kIoThreads;
extern const Setting kMaxConcurrentHandshakes;
extern const Setting kMaxGrantsPerPeer;
extern const Setting kShmMaxMappedBytesPerPeer;
extern const Setting kShmMaxMappedBytesTotal;
extern const Setting kMaxConnectionsPerPeerName;
extern const Setting kReceivePoolIdleMs;
extern const Setting kDataPrefetchElements;
extern const Setting kMaxCallBytes;
extern const Setting kMaxCallsPerPeer;

inline constexpr size_t kSettingCount = 21;
extern const Setting* const kAll[kSettingCount];

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
