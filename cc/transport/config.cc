#include "cc/transport/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <vector>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/crypto.h"

extern char** environ;

namespace tf_rdma {
namespace {

constexpr char kPrefix[] = "TF_RDMA_";
// Where each numeric setting's value goes in a Config (text settings: ParseConfig).
struct NumericField {
  const Setting* setting;
  void (*store)(int64_t value, Config& config);
};
const NumericField kNumericFields[] = {
    {&settings::kPeerTimeoutMs, [](int64_t v, Config& c) { c.peer_timeout = absl::Milliseconds(v); }},
    {&settings::kConnectTimeoutMs, [](int64_t v, Config& c) { c.connect_timeout = absl::Milliseconds(v); }},
    {&settings::kPortOffset, [](int64_t v, Config& c) { c.port_offset = static_cast<int>(v); }},
    {&settings::kVerbsPort, [](int64_t v, Config& c) { c.verbs.port = static_cast<int>(v); }},
    {&settings::kVerbsGidIndex, [](int64_t v, Config& c) { c.verbs.gid_index = static_cast<int>(v); }},
    {&settings::kVerbsPollUs, [](int64_t v, Config& c) { c.verbs.poll_window = absl::Microseconds(v); }},
    {&settings::kStreamPollUs, [](int64_t v, Config& c) { c.stream_poll_window = absl::Microseconds(v); }},
    {&settings::kIoThreads, [](int64_t v, Config& c) { c.io_threads = static_cast<size_t>(v); }},
    {&settings::kMaxConcurrentHandshakes,
     [](int64_t v, Config& c) { c.limits.max_concurrent_handshakes = static_cast<size_t>(v); }},
    {&settings::kMaxGrantsPerPeer, [](int64_t v, Config& c) { c.limits.max_grants_per_peer = static_cast<size_t>(v); }},
    {&settings::kShmMaxMappedBytesPerPeer,
     [](int64_t v, Config& c) { c.limits.shm_max_mapped_bytes_per_peer = static_cast<uint64_t>(v); }},
    {&settings::kShmMaxMappedBytesTotal,
     [](int64_t v, Config& c) { c.limits.shm_max_mapped_bytes_total = static_cast<uint64_t>(v); }},
    {&settings::kMaxConnectionsPerPeerName,
     [](int64_t v, Config& c) { c.limits.max_connections_per_peer_name = static_cast<size_t>(v); }},
    {&settings::kReceivePoolIdleMs, [](int64_t v, Config& c) { c.receive_pool_idle = absl::Milliseconds(v); }},
    {&settings::kDataPrefetchElements, [](int64_t v, Config& c) { c.data_prefetch_elements = static_cast<int>(v); }},
    {&settings::kMaxCallBytes, [](int64_t v, Config& c) { c.max_call_bytes = static_cast<uint64_t>(v); }},
    {&settings::kMaxCallsPerPeer, [](int64_t v, Config& c) { c.max_calls_per_peer = static_cast<size_t>(v); }},
};

// A numeric setting's value from `value`, into its field of `config`.
absl::Status StoreNumber(const Setting& setting, const std::string& value, Config& config) {
  absl::StatusOr<int64_t> number = ParseSettingValue(setting, value);
  if (!number.ok()) return number.status();
  // A task's tf_rdma port would be its TensorFlow port.
  if (&setting == &settings::kPortOffset && *number == 0) return SettingValueError(setting, value);
  for (const NumericField& field : kNumericFields) {
    if (field.setting == &setting) {
      field.store(*number, config);
      return absl::OkStatus();
    }
  }
  return absl::InternalError(absl::StrCat(setting.name, " has no field in tf_rdma's Config (config.cc)"));
}

// A secret longer than this is not a secret someone typed or mounted by mistake: refused.
constexpr size_t kMaxSecretLength = 4096;

// SecretFlaw's rule, as the error states it.
constexpr char kSecretRule[] =
    "A secret must be at least 16 random bytes written as hex (32 digits or more) or base64 or "
    "base64url (22 characters or more, '=' padding optional), with no stretch of 40 bits (10 hex "
    "digits, 7 base64 characters) repeated or a run, not letters of one case only, and not a UUID "
    "(see docs/security.md)";

// The command runs as printed in the environment that got the error: tf_rdma's import refuses
// that environment's secret, so the command drops both variables that could carry it.
constexpr char kMakeASecret[] =
    "Make one with `env -u TF_RDMA_SECRET -u TF_RDMA_SECRET_FILE python -m tf_rdma secret` (256 "
    "random bits; or `openssl rand -base64 32`) and give every task the same";

absl::Status SecretFileError(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "TF_RDMA_SECRET_FILE='", path, "' ", what,
      ". Point it at the regular file holding the cluster's secret (e.g. a mounted Kubernetes "
      "Secret) or unset it."));
}

const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "of an unknown kind";
}

// Up to kMaxSecretLength + 1 bytes of the regular file open as `fd`.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, int fd) {
  struct stat status {};
  if (fstat(fd, &status) != 0) {
    return SecretFileError(path, absl::StrCat("cannot be examined: ", std::strerror(errno)));
  }
  if (!S_ISREG(status.st_mode)) {
    return SecretFileError(path, absl::StrCat("is ", FileKind(status.st_mode), ", not a regular file"));
  }
  std::string content(kMaxSecretLength + 1, '\0');
  size_t filled = 0;
  while (filled < content.size()) {
    const ssize_t n = read(fd, content.data() + filled, content.size() - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return SecretFileError(path, absl::StrCat("cannot be read: ", std::strerror(errno)));
    if (n == 0) break;
    filled += static_cast<size_t>(n);
  }
  content.resize(filled);
  return content;
}

// Only a regular file: a FIFO would block the import of tf_rdma until something writes to it, and
// a device (/dev/zero, /dev/urandom) would pass for a secret that no other task shares. O_NONBLOCK
// makes opening a FIFO without a writer return at once, so that it is refused; a regular file's
// reads ignore the flag.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return SecretFileError(path, absl::StrCat("cannot be read: ", std::strerror(errno)));
  absl::StatusOr<std::string> read = ReadRegularFile(path, fd);
  close(fd);
  if (!read.ok()) return read.status();
  std::string secret = *std::move(read);
  if (secret.size() > kMaxSecretLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TF_RDMA_SECRET_FILE='", path, "' holds more than ", kMaxSecretLength,
        " bytes, which is not a secret; point it at the secret's file. ", kMakeASecret, "."));
  }
  // Files written by editors and `echo` end with a line break that is not part of the secret.
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TF_RDMA_SECRET_FILE='", path, "' is empty. ", kMakeASecret, " file."));
  }
  return secret;
}

absl::Status CheckSecretStrength(const std::string& variable, const std::string& secret) {
  const std::string flaw = SecretFlaw(secret);
  if (flaw.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      variable, " is too weak to keep the cluster closed: it ", flaw, ". ", kSecretRule,
      ": whoever a task dials (anything listening at a peer's address) sees a proof made with the "
      "secret and can test guesses of it offline. ", kMakeASecret, " value."));
}

// ASCII only, whatever the locale (Python sets LC_CTYPE from the user's: under ISO-8859-1,
// std::isalnum took byte 0xE9 for a base64 character).
bool IsHexDigit(char c) { return absl::ascii_isxdigit(c); }
bool IsBase64Character(char c) {
  return absl::ascii_isalnum(c) || c == '+' || c == '/' || c == '-' || c == '_';
}

// Whether `stretch` is one character repeated, or counts up or down one code at a time.
bool IsRun(std::string_view stretch) {
  for (int step : {0, 1, -1}) {
    bool run = true;
    for (size_t i = 1; i < stretch.size() && run; ++i) run = stretch[i] - stretch[i - 1] == step;
    if (run) return true;
  }
  return false;
}

// 8-4-4-4-12 hex digits: base64url's characters, but at most 122 random bits (`uuidgen`), and
// few a guesser does not know in a time-based one (`uuidgen -t`).
bool IsUuid(std::string_view text) {
  if (text.size() != 36) return false;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool dash_here = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash_here ? text[i] != '-' : !IsHexDigit(text[i])) return false;
  }
  return true;
}

}  // namespace

std::string SecretFlaw(std::string_view secret) {
  if (IsUuid(secret)) return "is a UUID, at most 122 random bits (none to speak of in a time-based one)";
  const bool hex = std::all_of(secret.begin(), secret.end(), IsHexDigit);
  std::string_view text = secret;
  if (!hex) {
    // base64's padding, if any, carries no bits.
    for (int pad = 0; pad < 2 && !text.empty() && text.back() == '='; ++pad) text.remove_suffix(1);
    if (!std::all_of(text.begin(), text.end(), IsBase64Character)) {
      return "holds characters that neither hex nor base64 uses (spaces, line breaks, punctuation)";
    }
  }
  if (hex && text.size() % 2 != 0) return "is an odd number of hex digits, not whole bytes";
  if (!hex && text.size() % 4 == 1) return "has a length (4n+1 characters) that no base64 text has";
  const size_t bytes = hex ? text.size() / 2 : text.size() * 6 / 8;
  if (bytes < kMinSecretBytes) {
    return absl::StrCat("writes ", bytes, " bytes in ", hex ? "hex" : "base64", ", fewer than ", kMinSecretBytes);
  }
  const size_t stretch = hex ? kPatternStretchHex : kPatternStretchBase64;
  std::set<std::string_view> seen;
  for (size_t at = 0; at + stretch <= text.size(); ++at) {
    const std::string_view window = text.substr(at, stretch);
    if (IsRun(window)) {
      return absl::StrCat("holds a run of ", stretch, " characters (one repeated, or counting up or down)");
    }
    if (!seen.insert(window).second) return absl::StrCat("repeats a stretch of ", stretch, " characters");
  }
  const size_t upper = std::count_if(text.begin(), text.end(), absl::ascii_isupper);
  if (std::all_of(text.begin(), text.end(), absl::ascii_isalpha) && (upper == 0 || upper == text.size())) {
    return "is letters of one case only, as words are";
  }
  return "";
}

absl::StatusOr<std::string> ClusterKey(std::string_view secret) {
  absl::Status crypto = LoadCrypto();
  if (!crypto.ok()) return crypto;
  // The secret alone, not the cluster's shape: that may change while the cluster runs (clients
  // join, jobs are renamed at connect time). The secret is length-prefixed, so that HKDF's input
  // keying material is never empty (OpenSSL refuses an empty one) and no secret encodes as another.
  std::string keying_material;
  AppendLengthPrefixed(keying_material, secret);
  std::string key(32, '\0');
  absl::Status derived = HkdfSha256(keying_material, "tf_rdma cluster key", "tf_rdma handshake",
                                    reinterpret_cast<uint8_t*>(key.data()), key.size());
  if (!derived.ok()) return derived;
  return key;
}

absl::StatusOr<Config> ParseConfig(const std::map<std::string, std::string>& environment) {
  Config config;
  for (const auto& [name, value] : environment) {
    if (name.rfind(kPrefix, 0) != 0) continue;
    const Setting* setting = FindSetting(name);
    if (setting == nullptr) {
      // Any other TF_RDMA_* name is a typo.
      std::vector<std::string> known;
      for (const Setting* known_setting : settings::kAll) known.push_back(known_setting->name);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown environment variable ", name, "; tf_rdma reads only ",
          absl::StrJoin(known, ", "), ". Fix the name or unset it."));
    }
    if (setting->kind != SettingKind::kText) {
      absl::Status stored = StoreNumber(*setting, value, config);
      if (!stored.ok()) return stored;
    } else if (setting == &settings::kBackend) {
      if (value != settings::kBackend.default_label && !ParseBackend(value).ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "='", value, "' is not a backend; use one of ", settings::kBackend.default_label,
            ", ", BackendNames()));
      }
      config.backend = value;
    } else if (setting == &settings::kSecret) {
      if (value.size() > kMaxSecretLength) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, " is longer than ", kMaxSecretLength, " bytes. ", kMakeASecret, " value."));
      }
      if (!value.empty()) {
        absl::Status strong = CheckSecretStrength(name, value);
        if (!strong.ok()) return strong;
      }
      config.secret = value;
    } else if (setting == &settings::kSecretFile) {
      if (environment.count(settings::kSecret.name)) {
        return absl::InvalidArgumentError(
            "both TF_RDMA_SECRET and TF_RDMA_SECRET_FILE are set; set only one of them");
      }
      absl::StatusOr<std::string> secret = ReadSecretFile(value);
      if (!secret.ok()) return secret.status();
      absl::Status strong = CheckSecretStrength(absl::StrCat("the secret in ", name, "='", value, "'"), *secret);
      if (!strong.ok()) return strong;
      config.secret = *std::move(secret);
    } else if (setting == &settings::kVerbsDevice) {
      // Device names are sysfs names: short, no path separators.
      if (value.empty() || value.size() > 63 || value.find('/') != std::string::npos ||
          value.find_first_of(" \t\n") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "='", value, "' is not an RDMA device name; use a name that "
            "`ibv_devices` lists (e.g. mlx5_0, rxe0) or unset it"));
      }
      config.verbs.device = value;
    } else {
      return absl::InternalError(absl::StrCat(name, " is a text setting config.cc does not read"));
    }
  }
  return config;
}

absl::StatusOr<Config> LoadConfigFromEnvironment() {
  std::map<std::string, std::string> environment;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const size_t equals = text.find('=');
    if (equals == std::string::npos || text.rfind(kPrefix, 0) != 0) continue;
    environment[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return ParseConfig(environment);
}

TransportOptions TransportOptionsFrom(const Config& config) {
  TransportOptions options;
  options.peer_timeout = config.peer_timeout;
  options.connect_timeout = config.connect_timeout;
  options.io_threads = config.io_threads;
  options.stream_poll_window = config.stream_poll_window;
  options.limits = config.limits;
  options.verbs = config.verbs;
  return options;
}

}  // namespace tf_rdma
