#include "cc/transport/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <net/if_arp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/transport/error_kinds.h"

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

// What a device's port is and how rdma_cm reaches it, for errors.
struct PortReport {
  int number = 0;
  ibv_port_state state = IBV_PORT_NOP;
  bool infiniband = false;             // reached by its IPoIB interface's address, not by its GIDs
  std::vector<std::string> addresses;  // "10.77.0.1 on dummy0", from the port's RoCE GIDs
  std::set<unsigned> interfaces;       // ifindexes of the netdevs those GIDs belong to
};

struct DeviceReport {
  std::string name;
  std::vector<PortReport> ports;
  std::string error;  // set when the device could not be opened or queried
};

// The IP address a RoCE GID stands for: IPv4 for the IPv4-mapped ones.
std::string GidAddress(const ibv_gid& gid) {
  static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(gid.raw, kMapped, sizeof(kMapped)) != 0) return GidToString(gid);
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, gid.raw + 12, text, sizeof(text));
  return text;
}

// Fills the port's IP addresses and interfaces from its GID table. Walks every entry (rxe has
// 1024): for errors and for a connection being set up, never per transfer.
void AddAddresses(ibv_context* context, const ibv_port_attr& attr, PortReport* port) {
  port->infiniband = attr.link_layer == IBV_LINK_LAYER_INFINIBAND;
  if (port->infiniband) return;
  for (int i = 0; i < attr.gid_tbl_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, port->number, i, &entry, 0) != 0 || entry.ndev_ifindex == 0) continue;
    if (IsLinkLocal(entry.gid)) continue;
    port->interfaces.insert(entry.ndev_ifindex);
    char name[IF_NAMESIZE] = {};
    std::string address = GidAddress(entry.gid);
    if (if_indextoname(entry.ndev_ifindex, name) != nullptr) absl::StrAppend(&address, " on ", name);
    // RoCE v1 and v2 GIDs of one address say the same here.
    if (std::find(port->addresses.begin(), port->addresses.end(), address) == port->addresses.end()) {
      port->addresses.push_back(std::move(address));
    }
  }
}

// Every device in the list with its ports, opening each briefly; with their IP addresses if asked.
std::vector<DeviceReport> Inventory(ibv_device** devices, int count, bool with_addresses) {
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
      for (int number = 1; number <= attr.phys_port_cnt; ++number) {
        ibv_port_attr port_attr{};
        if (ibv_query_port(context, number, &port_attr) != 0) continue;
        PortReport port;
        port.number = number;
        port.state = port_attr.state;
        if (with_addresses) AddAddresses(context, port_attr, &port);
        report.ports.push_back(std::move(port));
      }
    }
    if (context != nullptr) ibv_close_device(context);
    reports.push_back(std::move(report));
  }
  return reports;
}

// The inventory of every device ibv_get_device_list returns (empty if none).
std::vector<DeviceReport> InventoryAll(bool with_addresses) {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  if (devices == nullptr) return {};
  std::vector<DeviceReport> reports = Inventory(devices, count, with_addresses);
  ibv_free_device_list(devices);
  return reports;
}

// "rxe0 (port 1 ACTIVE, 10.77.0.1 on dummy0); rxe1 (...)"; addresses only if inventoried.
std::string Describe(const std::vector<DeviceReport>& reports) {
  std::vector<std::string> parts;
  for (const auto& report : reports) {
    if (!report.error.empty()) {
      parts.push_back(absl::StrCat(report.name, " (", report.error, ")"));
      continue;
    }
    std::vector<std::string> ports;
    for (const PortReport& port : report.ports) {
      std::string text = absl::StrCat("port ", port.number, " ", PortStateName(port.state));
      if (port.infiniband) {
        absl::StrAppend(&text, ", InfiniBand: reached by its IPoIB interface's address");
      } else if (!port.addresses.empty()) {
        absl::StrAppend(&text, ", ", absl::StrJoin(port.addresses, ", "));
      }
      ports.push_back(std::move(text));
    }
    parts.push_back(absl::StrCat(report.name, " (", absl::StrJoin(ports, "; "), ")"));
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, "; ");
}

// The local address the kernel sends from toward `destination`, and the interface that holds it.
struct Source {
  std::string address;
  std::string interface;  // empty if no interface holds it
  unsigned ifindex = 0;
};

// An error only when the kernel has no route; a source it cannot tell has ifindex 0.
absl::StatusOr<Source> SourceToward(const sockaddr* destination, socklen_t length) {
  const int fd = socket(destination->sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Source{};
  // A datagram socket's connect sends nothing: it only asks the kernel for the route.
  sockaddr_storage local{};
  socklen_t local_length = sizeof(local);
  const bool routed = connect(fd, destination, length) == 0;
  const int error = errno;
  const bool named = routed && getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) == 0;
  close(fd);
  if (!routed && (error == ENETUNREACH || error == EHOSTUNREACH)) {
    return absl::UnavailableError(std::strerror(error));
  }
  if (!named) return Source{};
  Source source;
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = local.ss_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
  inet_ntop(local.ss_family, raw, text, sizeof(text));
  source.address = text;
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return source;
  for (ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != local.ss_family) continue;
    const bool same = local.ss_family == AF_INET
        ? reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
              reinterpret_cast<sockaddr_in*>(&local)->sin_addr.s_addr
        : std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                      &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, sizeof(in6_addr)) == 0;
    if (!same) continue;
    source.interface = i->ifa_name;
    source.ifindex = if_nametoindex(i->ifa_name);
    break;
  }
  freeifaddrs(interfaces);
  return source;
}

// IPoIB interfaces carry rdma_cm to InfiniBand ports; their GIDs name no netdev.
bool IsIpoib(const std::string& interface) {
  std::ifstream type("/sys/class/net/" + interface + "/type");
  int value = 0;
  return static_cast<bool>(type >> value) && value == ARPHRD_INFINIBAND;
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
  std::vector<DeviceReport> reports = Inventory(devices, count, false);
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
    for (const PortReport& port : report.ports) {
      if (settings.port != 0 && port.number != settings.port) continue;
      port_found = true;
      if (port.state == IBV_PORT_ACTIVE) return absl::OkStatus();
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
        DescribeDevices(), ". Use one of those names or unset it"));
  }
  return absl::UnimplementedError(absl::StrCat(
      "no active port on ", settings.device.empty() ? "any RDMA device" : settings.device,
      ": ", Describe(reports), ". Check the cable/link (`ibv_devinfo`, `rdma link`), or choose "
      "another device with TF_RDMA_VERBS_DEVICE / TF_RDMA_VERBS_PORT"));
}

std::string DescribeDevices() { return Describe(InventoryAll(true)); }

absl::Status DeviceMismatchError(std::string message) {
  return WithErrorKind(absl::FailedPreconditionError(std::move(message)), ErrorKind::kRdmaDeviceMismatch);
}

absl::Status CheckRdmaRoute(const sockaddr* destination, socklen_t length, const std::string& peer) {
  absl::StatusOr<Source> source = SourceToward(destination, length);
  if (source.ok() && (source->ifindex == 0 || IsIpoib(source->interface))) return absl::OkStatus();
  const std::vector<DeviceReport> devices = InventoryAll(true);
  const std::string fix = absl::StrCat(
      "RDMA devices here: ", Describe(devices), ". Name the peer by the IP address of its RDMA "
      "interface (in the cluster spec, or rdma_addresses=), or set TF_RDMA_BACKEND=tcp");
  if (!source.ok()) {
    return DeviceMismatchError(absl::StrCat("no RDMA device reaches ", peer, ": this host has no IP route to it (",
                                                      source.status().message(), "). ", fix));
  }
  for (const DeviceReport& device : devices) {
    for (const PortReport& port : device.ports) {
      if (port.interfaces.count(source->ifindex) != 0) return absl::OkStatus();
    }
  }
  return DeviceMismatchError(absl::StrCat(
      "no RDMA device reaches ", peer, ": this host sends to it from ", source->address, " on ",
      source->interface, ", and ", source->interface, " is no RDMA device's interface. ", fix));
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
