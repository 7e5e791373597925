#include "cc/transport/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/config.h"

namespace tf_rdma::verbs {
namespace {

std::atomic<int64_t> pinned_bytes{0};

const char* PortStateName(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default: return "NOP";
  }
}

const char* GidTypeName(uint32_t type) {
  switch (type) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCE v2";
    default: return "unknown type";
  }
}

// "rxe0 (port 1: ACTIVE)" for every device in the list, opening each briefly.
struct DeviceReport {
  std::string name;
  std::vector<std::pair<int, ibv_port_state>> ports;
  std::string error;  // set when the device could not be opened or queried
};

std::vector<DeviceReport> Inventory(ibv_device** devices, int count) {
  std::vector<DeviceReport> reports;
  for (int i = 0; i < count; ++i) {
    DeviceReport report{ibv_get_device_name(devices[i])};
    ibv_context* context = ibv_open_device(devices[i]);
    ibv_device_attr attr{};
    if (context == nullptr) {
      report.error = absl::StrCat("cannot open: ", std::strerror(errno));
    } else if (ibv_query_device(context, &attr) != 0) {
      report.error = absl::StrCat("cannot query: ", std::strerror(errno));
    } else {
      for (int port = 1; port <= attr.phys_port_cnt; ++port) {
        ibv_port_attr port_attr{};
        if (ibv_query_port(context, port, &port_attr) == 0) {
          report.ports.emplace_back(port, port_attr.state);
        }
      }
    }
    if (context != nullptr) ibv_close_device(context);
    reports.push_back(std::move(report));
  }
  return reports;
}

std::string Describe(const std::vector<DeviceReport>& reports) {
  std::vector<std::string> parts;
  for (const auto& report : reports) {
    if (!report.error.empty()) {
      parts.push_back(absl::StrCat(report.name, " (", report.error, ")"));
      continue;
    }
    std::vector<std::string> ports;
    for (const auto& [number, state] : report.ports) {
      ports.push_back(absl::StrCat("port ", number, " ", PortStateName(state)));
    }
    parts.push_back(absl::StrCat(report.name, " (", absl::StrJoin(ports, ", "), ")"));
  }
  return absl::StrJoin(parts, "; ");
}

bool HasCapIpcLock() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const uint64_t caps = std::stoull(line.substr(7), nullptr, 16);
      return (caps >> 14) & 1;  // CAP_IPC_LOCK
    }
  }
  return false;
}

size_t RoundUpKiB(size_t bytes) { return (bytes + 1023) / 1024; }

std::string MemlockAdvice(const std::string& what, size_t bytes, const std::string& device,
                          rlim_t limit) {
  const size_t needed = PinnedBytes() + bytes;
  return absl::StrCat(
      "cannot register ", bytes, " bytes of ", what, " with RDMA device ", device,
      ": the locked-memory limit (ulimit -l) is ", RoundUpKiB(limit), " KiB and tf_rdma needs at least ",
      RoundUpKiB(needed), " KiB pinned (", RoundUpKiB(PinnedBytes()),
      " KiB already registered by tf_rdma). Raise it to at least ", RoundUpKiB(needed),
      " KiB, better unlimited: `ulimit -l unlimited` in the launching shell, LimitMEMLOCK=infinity "
      "for systemd services, `--ulimit memlock=-1` for docker, or a memlock line in "
      "/etc/security/limits.conf");
}

}  // namespace

absl::StatusOr<VerbsSettings> LoadVerbsSettings() {
  absl::StatusOr<Config> config = LoadConfigFromEnvironment();
  if (!config.ok()) return config.status();
  return VerbsSettings{config->verbs_device, config->verbs_port, config->verbs_gid_index};
}

std::string DeviceName(ibv_context* context) {
  return context && context->device ? ibv_get_device_name(context->device) : "(none)";
}

std::string GidToString(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
  return text;
}

bool IsLinkLocal(const ibv_gid& gid) { return gid.raw[0] == 0xfe && (gid.raw[1] & 0xc0) == 0x80; }

absl::Status CheckVerbsUsable(const VerbsSettings& settings) {
  int count = 0;
  errno = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  if (devices == nullptr) {
    const int error = errno;
    return absl::UnimplementedError(absl::StrCat(
        "no RDMA device: ibv_get_device_list failed (", std::strerror(error), ")",
        error == ENOSYS ? "; this kernel has no RDMA support (CONFIG_INFINIBAND)" : ""));
  }
  std::vector<DeviceReport> reports = Inventory(devices, count);
  ibv_free_device_list(devices);
  if (reports.empty()) {
    return absl::UnimplementedError(
        "no RDMA device found (ibv_get_device_list returned none); load the NIC's RDMA driver and "
        "provider (`ibv_devices` and `rdma link` should list it)");
  }
  bool named_found = settings.device.empty();
  for (const auto& report : reports) {
    if (!settings.device.empty() && report.name != settings.device) continue;
    named_found = true;
    bool port_found = settings.port == 0;
    for (const auto& [number, state] : report.ports) {
      if (settings.port != 0 && number != settings.port) continue;
      port_found = true;
      if (state == IBV_PORT_ACTIVE) return absl::OkStatus();
    }
    if (!port_found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TF_RDMA_VERBS_PORT=", settings.port, " does not exist on device ", report.name,
          "; devices found: ", Describe(reports), ". Use one of those ports or unset it"));
    }
  }
  if (!named_found) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TF_RDMA_VERBS_DEVICE=", settings.device, " does not exist; devices found: ",
        Describe(reports), ". Use one of those names or unset it"));
  }
  return absl::UnimplementedError(absl::StrCat(
      "no active port on ", settings.device.empty() ? "any RDMA device" : settings.device,
      ": ", Describe(reports), ". Check the cable/link (`ibv_devinfo`, `rdma link`), or choose "
      "another device with TF_RDMA_VERBS_DEVICE / TF_RDMA_VERBS_PORT"));
}

absl::Status CheckPortAndGid(ibv_context* context, int port, int gid_index) {
  ibv_port_attr port_attr{};
  if (ibv_query_port(context, port, &port_attr) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("port ", port, " of RDMA device ", DeviceName(context),
                                            " does not exist (", std::strerror(errno), ")"));
  }
  if (port_attr.state != IBV_PORT_ACTIVE) {
    return absl::UnimplementedError(absl::StrCat(
        "port ", port, " of RDMA device ", DeviceName(context), " is ",
        PortStateName(port_attr.state), ", not ACTIVE; check the link (`ibv_devinfo`)"));
  }
  if (gid_index < 0) return absl::OkStatus();
  // The GIDs worth suggesting: the routable ones (RoCE v2 first).
  std::vector<std::string> routable;
  for (int i = 0; i < port_attr.gid_tbl_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, port, i, &entry, 0) != 0) continue;
    if (IsLinkLocal(entry.gid)) continue;
    routable.push_back(absl::StrCat(i, " (", GidToString(entry.gid), ", ", GidTypeName(entry.gid_type), ")"));
  }
  const std::string suggestion = absl::StrCat(
      "routable GIDs on ", DeviceName(context), " port ", port, ": ",
      routable.empty() ? "none (is an IP address configured on the port's netdev?)" : absl::StrJoin(routable, ", "),
      ". Set TF_RDMA_VERBS_GID_INDEX to one of them or unset it (rdma_cm then picks the RoCE v2 GID of "
      "the IP address)");
  ibv_gid_entry entry{};
  if (gid_index >= port_attr.gid_tbl_len || ibv_query_gid_ex(context, port, gid_index, &entry, 0) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TF_RDMA_VERBS_GID_INDEX=", gid_index,
                                            " is not a valid GID entry; ", suggestion));
  }
  if (IsLinkLocal(entry.gid)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TF_RDMA_VERBS_GID_INDEX=", gid_index, " is the link-local GID ", GidToString(entry.gid),
        " (", GidTypeName(entry.gid_type), "), which is not routable between hosts; ", suggestion));
  }
  return absl::OkStatus();
}

void EnsureForkSafety() {
  static std::once_flag once;
  std::call_once(once, [] {
    // A kernel that copies DMA pages on fork (Linux 5.13+) keeps children safe by itself. There,
    // ibv_fork_init would only madvise(DONTFORK) every registered range, rounded to pages: a
    // registered send buffer's neighbours in the heap would be missing in a child, which then
    // crashes touching them.
    if (ibv_is_fork_initialized() == IBV_FORK_UNNEEDED) return;
    // Must run before the first registration; afterwards it is refused.
    const int rc = ibv_fork_init();
    if (rc != 0) {
      LOG(WARNING) << "tf_rdma: ibv_fork_init failed (" << std::strerror(rc < 0 ? -rc : rc)
                   << "); a child process touching registered memory may corrupt RDMA transfers";
    }
  });
}

size_t PinnedBytes() { return static_cast<size_t>(std::max<int64_t>(pinned_bytes.load(), 0)); }
void AddPinnedBytes(ptrdiff_t delta) { pinned_bytes += delta; }

absl::Status CheckMemlockAllows(const std::string& what, size_t bytes, const std::string& device) {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return absl::OkStatus();
  if (PinnedBytes() + bytes <= limit.rlim_cur || HasCapIpcLock()) return absl::OkStatus();
  return absl::ResourceExhaustedError(MemlockAdvice(what, bytes, device, limit.rlim_cur));
}

absl::Status RegistrationError(const std::string& what, size_t bytes, int error,
                               const std::string& device) {
  rlimit limit{};
  const bool limited = getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
                       !HasCapIpcLock();
  if ((error == ENOMEM || error == EPERM || error == EAGAIN) && limited) {
    return absl::ResourceExhaustedError(absl::StrCat(MemlockAdvice(what, bytes, device, limit.rlim_cur),
                                                     " (ibv_reg_mr: ", std::strerror(error), ")"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "cannot register ", bytes, " bytes of ", what, " with RDMA device ", device, ": ibv_reg_mr: ",
      std::strerror(error), error == ENOMEM ? " (the device ran out of translation resources or "
                                              "the host of memory; register less)" : ""));
}

}  // namespace tf_rdma::verbs
