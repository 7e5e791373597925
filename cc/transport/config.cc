#include "cc/transport/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/crypto.h"

extern char** environ;

namespace tf_rdma {
namespace {

constexpr char kPrefix[] = "TF_RDMA_";
absl::StatusOr<absl::Duration> ParseMilliseconds(const std::string& name, const std::string& value,
                                                 int64_t minimum) {
  int64_t ms = 0;
  if (!absl::SimpleAtoi(value, &ms) || ms < minimum || ms > 86400000) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, "='", value, "' is not a whole number of milliseconds between ", minimum,
        " and 86400000; set it to e.g. 30000 or unset it"));
  }
  return absl::Milliseconds(ms);
}

// A count or size in [minimum, maximum] into `*limit`; `unit_suffixes` also takes K, M, G, T
// (powers of 1024), so that sizes such as 64G need no arithmetic.
template <typename Limit>
absl::Status ParseLimit(const std::string& name, const std::string& value, uint64_t minimum,
                        uint64_t maximum, bool unit_suffixes, const char* example, Limit* limit) {
  std::string digits = value;
  int shift = 0;
  if (unit_suffixes && !digits.empty()) {
    const size_t unit = std::string("KMGT").find(digits.back());
    if (unit != std::string::npos) {
      shift = 10 * static_cast<int>(unit + 1);
      digits.pop_back();
    }
  }
  uint64_t number = 0;
  if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos &&
      absl::SimpleAtoi(digits, &number) && number <= (maximum >> shift) &&
      (number << shift) >= minimum) {
    *limit = static_cast<Limit>(number << shift);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      name, "='", value, "' is not a whole number", unit_suffixes ? " of bytes (K, M, G, T allowed)" : "",
      " between ", minimum, " and ", maximum, "; set it to e.g. ", example, " or unset it"));
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

const std::vector<ConfigVariable>& ConfigVariables() {
  static const auto* variables = new std::vector<ConfigVariable>{
      {"TF_RDMA_BACKEND", "auto",
       "Transport for tensors between tasks: auto (shm for peers on this host, verbs where an RDMA "
       "device reaches the peer's address, else tcp), verbs, tcp or shm. An explicit backend that "
       "cannot work is an error."},
      {"TF_RDMA_PEER_TIMEOUT_MS", "30000",
       "A peer silent this long (no data, no heartbeat) is declared dead and its pending transfers fail."},
      {"TF_RDMA_CONNECT_TIMEOUT_MS", "60000",
       "How long connecting to a peer is retried (peers may start in any order) before failing."},
      {"TF_RDMA_PORT_OFFSET", "1000",
       "Each task's tf_rdma listener port is its TensorFlow server port plus this (may be "
       "negative). Every task of a cluster must use the same value."},
      {"TF_RDMA_SECRET", "(empty)",
       "Shared secret the cluster key is derived from: peers without it cannot connect or write. "
       "At least 16 random bytes in hex or base64, no pattern (make one with `python -m tf_rdma "
       "secret`; docs/security.md states the rule); empty: no secret, "
       "anyone who reaches a tf_rdma port can join."},
      {"TF_RDMA_SECRET_FILE", "(unset)",
       "A regular file holding TF_RDMA_SECRET (e.g. a mounted Kubernetes Secret; trailing line "
       "breaks are ignored; a FIFO or device is refused). Setting both is an error."},
      {"TF_RDMA_VERBS_DEVICE", "(auto)",
       "verbs: the RDMA device to use (a name from `ibv_devices`, e.g. mlx5_0). Default: the device "
       "whose port carries the peer's IP route, as rdma_cm resolves it."},
      {"TF_RDMA_VERBS_PORT", "(auto)",
       "verbs: the device port to use (1-based, see `ibv_devinfo`). Default: the port rdma_cm resolves."},
      {"TF_RDMA_VERBS_GID_INDEX", "(auto)",
       "verbs: the source GID table index (see `show_gids`/`ibv_devinfo -v`). Default: the RoCE v2 GID "
       "of the local IP address, as rdma_cm resolves it."},
      {"TF_RDMA_VERBS_POLL_US", "100",
       "verbs: microseconds the I/O thread serving a connection keeps polling for its completions "
       "after the last one before it sleeps on completion events (0: sleep at once). Polling "
       "lowers small-message latency and spends a core while it lasts."},
      {"TF_RDMA_STREAM_POLL_US", "0",
       "tcp and shm: microseconds an I/O thread keeps polling its connections after the last "
       "message before it sleeps (0: sleep at once). Polling lowers small-message latency (a "
       "thread's wake-up costs more than the message) but spends a core while it lasts, which "
       "slows TensorFlow's own threads on a host with few cores; a thread allowed on one core only "
       "does not poll."},
      {"TF_RDMA_IO_THREADS", "2",
       "Threads that serve all of a transport's connections (epoll loops), whatever the number of "
       "peers. More spread many busy peers over more cores."},
      {"TF_RDMA_MAX_CONCURRENT_HANDSHAKES", "64",
       "Handshakes a listener runs at once (a thread and a descriptor each); clients beyond it are "
       "refused at once."},
      {"TF_RDMA_MAX_GRANTS_PER_PEER", "65536",
       "Grants a peer may have outstanding here that no write used yet; more close its connection."},
      {"TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", "64G",
       "shm: bytes of a peer's shared regions this process maps; more close its connection."},
      {"TF_RDMA_DATA_PREFETCH_ELEMENTS", "2",
       "tf.data service: elements past the one being read that a trainer keeps receive buffers "
       "granted for, per worker task (0 to 64); each holds about one element's bytes."},
      {"TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL", "1T",
       "shm: bytes of all peers' shared regions this process maps together; a region past it "
       "closes the connection that shared it."},
      {"TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME", "16",
       "Live connections (per backend) with peers claiming one task name; more are refused."},
      {"TF_RDMA_RECEIVE_POOL_IDLE_MS", "30000",
       "A region of a peer's receive pool that held no received tensor or grant for this long is "
       "freed (on verbs, unpinned); 0 keeps regions for the connection's life."},
  };
  return *variables;
}

absl::StatusOr<Config> ParseConfig(const std::map<std::string, std::string>& environment) {
  Config config;
  for (const auto& [name, value] : environment) {
    if (name.rfind(kPrefix, 0) != 0) continue;
    if (name == "TF_RDMA_BACKEND") {
      if (value != "auto" && !ParseBackend(value).ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_BACKEND='", value, "' is not a backend; use one of auto, ", BackendNames()));
      }
      config.backend = value;
    } else if (name == "TF_RDMA_PEER_TIMEOUT_MS") {
      absl::StatusOr<absl::Duration> d = ParseMilliseconds(name, value, 100);
      if (!d.ok()) return d.status();
      config.peer_timeout = *d;
    } else if (name == "TF_RDMA_CONNECT_TIMEOUT_MS") {
      absl::StatusOr<absl::Duration> d = ParseMilliseconds(name, value, 1);
      if (!d.ok()) return d.status();
      config.connect_timeout = *d;
    } else if (name == "TF_RDMA_PORT_OFFSET") {
      if (!absl::SimpleAtoi(value, &config.port_offset) || config.port_offset == 0 ||
          config.port_offset < -65535 || config.port_offset > 65535) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_PORT_OFFSET='", value, "' is not a non-zero whole number between -65535 and "
            "65535; set it to e.g. 1000 or unset it"));
      }
    } else if (name == "TF_RDMA_RECEIVE_POOL_IDLE_MS") {
      absl::StatusOr<absl::Duration> d = ParseMilliseconds(name, value, 0);
      if (!d.ok()) return d.status();
      config.receive_pool_idle = *d;
    } else if (name == "TF_RDMA_DATA_PREFETCH_ELEMENTS") {
      absl::Status parsed = ParseLimit(name, value, 0, 64, false, "2", &config.data_prefetch_elements);
      if (!parsed.ok()) return parsed;
    } else if (name == "TF_RDMA_SECRET") {
      if (value.size() > kMaxSecretLength) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_SECRET is longer than ", kMaxSecretLength, " bytes. ", kMakeASecret, " value."));
      }
      if (!value.empty()) {
        absl::Status strong = CheckSecretStrength(name, value);
        if (!strong.ok()) return strong;
      }
      config.secret = value;
    } else if (name == "TF_RDMA_SECRET_FILE") {
      if (environment.count("TF_RDMA_SECRET")) {
        return absl::InvalidArgumentError(
            "both TF_RDMA_SECRET and TF_RDMA_SECRET_FILE are set; set only one of them");
      }
      absl::StatusOr<std::string> secret = ReadSecretFile(value);
      if (!secret.ok()) return secret.status();
      absl::Status strong = CheckSecretStrength(absl::StrCat("the secret in TF_RDMA_SECRET_FILE='", value, "'"), *secret);
      if (!strong.ok()) return strong;
      config.secret = *std::move(secret);
    } else if (name == "TF_RDMA_VERBS_DEVICE") {
      // Device names are sysfs names: short, no path separators.
      if (value.empty() || value.size() > 63 || value.find('/') != std::string::npos ||
          value.find_first_of(" \t\n") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_VERBS_DEVICE='", value, "' is not an RDMA device name; use a name that "
            "`ibv_devices` lists (e.g. mlx5_0, rxe0) or unset it"));
      }
      config.verbs.device = value;
    } else if (name == "TF_RDMA_VERBS_PORT") {
      int port = 0;
      if (!absl::SimpleAtoi(value, &port) || port < 1 || port > 255) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_VERBS_PORT='", value, "' is not a port number between 1 and 255 (ports count "
            "from 1, see `ibv_devinfo`); set it to e.g. 1 or unset it"));
      }
      config.verbs.port = port;
    } else if (name == "TF_RDMA_VERBS_GID_INDEX") {
      int index = -1;
      if (!absl::SimpleAtoi(value, &index) || index < 0 || index > 65535) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TF_RDMA_VERBS_GID_INDEX='", value, "' is not a GID table index between 0 and 65535 "
            "(see `show_gids` or `ibv_devinfo -v`); set it to e.g. 3 or unset it"));
      }
      config.verbs.gid_index = index;
    } else if (name == "TF_RDMA_VERBS_POLL_US") {
      int64_t micros = 0;
      absl::Status parsed = ParseLimit(name, value, 0, 1000000, false,
                                       "100 (0 sleeps on completion events at once)", &micros);
      if (!parsed.ok()) return parsed;
      config.verbs.poll_window = absl::Microseconds(micros);
    } else if (name == "TF_RDMA_STREAM_POLL_US") {
      int64_t micros = 0;
      absl::Status parsed =
          ParseLimit(name, value, 0, 1000000, false, "100 (0 sleeps at once)", &micros);
      if (!parsed.ok()) return parsed;
      config.stream_poll_window = absl::Microseconds(micros);
    } else if (name == "TF_RDMA_IO_THREADS") {
      absl::Status parsed = ParseLimit(name, value, 1, 64, false, "2", &config.io_threads);
      if (!parsed.ok()) return parsed;
    } else if (name == "TF_RDMA_MAX_CONCURRENT_HANDSHAKES") {
      absl::Status parsed = ParseLimit(name, value, 1, 100000, false, "64",
                                       &config.limits.max_concurrent_handshakes);
      if (!parsed.ok()) return parsed;
    } else if (name == "TF_RDMA_MAX_GRANTS_PER_PEER") {
      absl::Status parsed = ParseLimit(name, value, 1, uint64_t{1} << 32, false, "65536",
                                       &config.limits.max_grants_per_peer);
      if (!parsed.ok()) return parsed;
    } else if (name == "TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER") {
      // At most 64 TiB, half of x86-64's user address space: more could never be mapped.
      absl::Status parsed = ParseLimit(name, value, 1, uint64_t{64} << 40, true, "64G",
                                       &config.limits.shm_max_mapped_bytes_per_peer);
      if (!parsed.ok()) return parsed;
    } else if (name == "TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL") {
      absl::Status parsed = ParseLimit(name, value, 1, uint64_t{64} << 40, true, "1T",
                                       &config.limits.shm_max_mapped_bytes_total);
      if (!parsed.ok()) return parsed;
    } else if (name == "TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME") {
      absl::Status parsed = ParseLimit(name, value, 1, 100000, false, "16",
                                       &config.limits.max_connections_per_peer_name);
      if (!parsed.ok()) return parsed;
    } else if (// An init-capture: C++17 (and clang before 16) cannot capture a structured binding.
               std::none_of(ConfigVariables().begin(), ConfigVariables().end(),
                            [&variable = name](const ConfigVariable& v) { return variable == v.name; })) {
      // Any other TF_RDMA_* name is a typo.
      std::vector<std::string> known;
      for (const auto& variable : ConfigVariables()) known.push_back(variable.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown environment variable ", name, "; tf_rdma reads only ",
          absl::StrJoin(known, ", "), ". Fix the name or unset it."));
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
