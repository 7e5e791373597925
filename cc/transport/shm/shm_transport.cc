#include "cc/transport/shm/shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <unordered_map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/transport/addresses.h"
#include "cc/transport/stream/socket_io.h"
#include "cc/transport/stream/stream_transport.h"

namespace tf_rdma {
namespace {

// Bytes of peers' regions this process maps: in all, against TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL,
// and by peer name, every connection under a name together, against
// TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER: a key holder's connections under one name get no more
// than one connection would, and cannot take the total from other names. Reserved before a
// region is mapped, given back with it.
class MappedBytes {
 public:
  // Reserves `region`'s bytes for the peer `name`, whose connection at hand maps
  // `connection_bytes` already.
  absl::Status Reserve(const std::string& name, uint64_t connection_bytes, const wire::ShmRegion& region,
                       const TransportLimits& limits) {
    const uint64_t per_peer = limits.shm_max_mapped_bytes_per_peer;
    if (region.size > per_peer - connection_bytes) {
      // One connection past the limit on its own: that peer's fault, whatever its name's others map.
      return absl::DataLossError(absl::StrCat(
          "SHM_REGION ", region.region_id, " of ", region.size, " bytes would make this process map more than ",
          per_peer, " bytes of the peer's regions, the limit TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER sets"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    const auto found = by_name_.find(name);
    const uint64_t by_name = found == by_name_.end() ? 0 : found->second;
    // min: transports of one process may be given different limits, and share these counts.
    if (region.size > per_peer - std::min(per_peer, by_name)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "SHM_REGION ", region.region_id, " of ", region.size, " bytes would make this process map more than ",
          per_peer, " bytes of the regions of peers named ", name, " (", by_name,
          " mapped now, over all their connections), the limit TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER sets for "
          "every peer name"));
    }
    if (region.size > limits.shm_max_mapped_bytes_total - std::min(limits.shm_max_mapped_bytes_total, total_)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "SHM_REGION ", region.region_id, " of ", region.size, " bytes would make this process map more than ",
          limits.shm_max_mapped_bytes_total, " bytes of all its peers' regions together (", total_,
          " mapped now), the limit TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL sets"));
    }
    if (region.size == 0) return absl::OkStatus();  // by_name_ holds names with bytes mapped only
    by_name_[name] = by_name + region.size;
    total_ += region.size;
    return absl::OkStatus();
  }

  void Release(const std::string& name, uint64_t bytes) {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    total_ -= bytes;
    auto it = by_name_.find(name);
    it->second -= bytes;
    if (it->second == 0) by_name_.erase(it);
  }

 private:
  std::mutex mu_;
  uint64_t total_ = 0;
  std::unordered_map<std::string, uint64_t> by_name_;  // names with bytes mapped only
};

MappedBytes& ProcessMappedBytes() {
  static auto* mapped = new MappedBytes;  // never destroyed: connections may outlive static destruction
  return *mapped;
}

// A peer maps our region: once the size is sealed, it can rely on every mapped page existing.
constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// Regions one peer may share with us, whatever their sizes: each mapping costs one of the process's
// memory map entries (about 65530, vm.max_map_count). tf_rdma's buffer pools share a few slabs.
constexpr size_t kMaxRegionsPerPeer = 4096;

class SharedRegion : public MemoryRegion {
 public:
  SharedRegion(uint32_t id, char* data, size_t size, int fd)
      : MemoryRegion(id, data, size), fd_(fd) {}
  ~SharedRegion() override {
    munmap(data(), std::max<size_t>(size(), 1));
    close(fd_);
  }
  int fd() const { return fd_; }

 private:
  const int fd_;
};

class ShmConnection : public StreamConnection {
 public:
  using StreamConnection::StreamConnection;
  ~ShmConnection() override { ReleaseMappings(); }

  // Unmapped (or once a copy into them finished) and given back to the peer name's share when the
  // connection ends, not when the last holder of this object lets go: a peer that reconnects must
  // find its name's share free.
  void OnRemoved() override {
    StreamConnection::OnRemoved();
    ReleaseMappings();
  }

 protected:
  absl::Status CheckLocalRegion(const MemoryRegion& region) override {
    if (dynamic_cast<const SharedRegion*>(&region) != nullptr) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "a shm connection can grant only regions allocated by the shm transport");
  }

  std::optional<ControlFrame> FrameBeforeGrant(const std::shared_ptr<MemoryRegion>& region) override {
    if (!shared_regions_.emplace(region->id(), region).second) return std::nullopt;
    const auto* shared = static_cast<const SharedRegion*>(region.get());
    return ControlFrame{{wire::FrameType::kShmRegion, wire::ShmRegion{region->id(), region->size()}},
                        shared->fd(), region};
  }

  // A region freed here stays mapped by the peer, its pages with it, until the peer hears it is
  // gone. It is gone once nothing holds it: no grant into it is out, and the SHM_REGION frame
  // that shared it went out (it holds the region until then), so this frame comes after both.
  std::vector<ControlFrame> FramesForGoneRegionsLocked() override {
    std::vector<ControlFrame> frames;
    for (auto it = shared_regions_.begin(); it != shared_regions_.end();) {
      if (!it->second.expired()) {
        ++it;
        continue;
      }
      frames.push_back(ControlFrame{{wire::FrameType::kShmRegionGone, wire::ShmRegionGone{it->first}}});
      it = shared_regions_.erase(it);
    }
    return frames;
  }

  absl::Status CheckRemoteGrant(const wire::Grant& grant) override {
    std::lock_guard<std::mutex> lock(mappings_mu_);
    auto it = mappings_.find(grant.region_id);
    if (it == mappings_.end()) {
      return absl::DataLossError(absl::StrCat("GRANT in region ", grant.region_id,
                                              ", which the peer never shared"));
    }
    // Against the region's real size: an empty region is mapped as a page that does not exist.
    if (grant.offset > it->second->size || grant.capacity > it->second->size - grant.offset) {
      return absl::DataLossError(absl::StrCat("GRANT of [", grant.offset, ", +", grant.capacity,
                                              ") outside region ", grant.region_id, " of ",
                                              it->second->size, " bytes"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> PlaceMessage(const wire::Grant& grant, const void* src, uint64_t length) override {
    // Held while copying: a peer that says a region is gone while its grant into it is out must
    // not make us copy into memory unmapped meanwhile.
    std::shared_ptr<const Mapping> mapping;
    {
      std::lock_guard<std::mutex> lock(mappings_mu_);
      auto it = mappings_.find(grant.region_id);
      if (it == mappings_.end()) {
        return absl::DataLossError(absl::StrCat("GRANT in region ", grant.region_id,
                                                ", which the peer said was gone"));
      }
      mapping = it->second;
    }
    // CheckRemoteGrant held the grant against the mapping of its day; a peer may since have said
    // the region was gone and shared another under the same id, smaller.
    if (grant.offset > mapping->size || length > mapping->size - grant.offset) {
      return absl::DataLossError(absl::StrCat("GRANT of [", grant.offset, ", +", length, ") in region ",
                                              grant.region_id, ", which the peer said was gone and shared again as ",
                                              mapping->size, " bytes"));
    }
    if (length > 0) std::memcpy(mapping->base + grant.offset, src, length);
    return false;
  }

  bool PayloadOnStream() const override { return false; }  // the sender placed it

  absl::Status OnShmRegion(const wire::ShmRegion& region, int fd) override {
    if (fd < 0) return absl::DataLossError("SHM_REGION frame without a file descriptor");
    absl::Status within_limits = CheckMappingLimits(region);
    if (!within_limits.ok()) {
      close(fd);
      return within_limits;
    }
    struct stat info {};
    const int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &info) != 0 || static_cast<uint64_t>(info.st_size) != region.size ||
        seals < 0 || (seals & kRequiredSeals) != kRequiredSeals) {
      close(fd);
      ProcessMappedBytes().Release(peer_name(), region.size);
      return absl::DataLossError(absl::StrCat("SHM_REGION ", region.region_id,
                                              ": descriptor is not a sealed region of ", region.size,
                                              " bytes"));
    }
    const size_t length = std::max<size_t>(region.size, 1);
    void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
      ProcessMappedBytes().Release(peer_name(), region.size);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map the peer's region of ", region.size, " bytes: ", std::strerror(errno)));
    }
    auto mapping = std::make_shared<const Mapping>(static_cast<char*>(base), length, region.size);
    std::lock_guard<std::mutex> lock(mappings_mu_);
    if (!mappings_.emplace(region.region_id, mapping).second) {
      ProcessMappedBytes().Release(peer_name(), region.size);
      return absl::DataLossError(absl::StrCat("region ", region.region_id, " shared twice"));
    }
    mapped_bytes_ += region.size;
    return absl::OkStatus();
  }

  absl::Status OnShmRegionGone(const wire::ShmRegionGone& gone) override {
    std::lock_guard<std::mutex> lock(mappings_mu_);
    auto it = mappings_.find(gone.region_id);
    if (it == mappings_.end()) {
      return absl::DataLossError(absl::StrCat("SHM_REGION_GONE for region ", gone.region_id,
                                              ", which the peer has not shared"));
    }
    mapped_bytes_ -= it->second->size;
    ProcessMappedBytes().Release(peer_name(), it->second->size);
    mappings_.erase(it);  // unmapped now, or once a copy into it finished
    return absl::OkStatus();
  }

 private:
  class Mapping {
   public:
    Mapping(char* base, size_t length, uint64_t size) : base(base), length(length), size(size) {}
    ~Mapping() { munmap(base, length); }
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;

    char* const base;
    const size_t length;  // mapped: at least a page's worth of address space
    const uint64_t size;  // the region's: what grants must lie in
  };

  void ReleaseMappings() {
    std::lock_guard<std::mutex> lock(mappings_mu_);
    ProcessMappedBytes().Release(peer_name(), mapped_bytes_);
    mapped_bytes_ = 0;
    mappings_.clear();
  }

  // Whether mapping `region` keeps this peer within its share of our address space; checked on
  // the declared size, before anything is mapped (a sparse memfd costs its sender nothing).
  // Reserved now, before mapping, so concurrent connections cannot pass the limits together;
  // given back if the region is refused below, and when the connection goes.
  absl::Status CheckMappingLimits(const wire::ShmRegion& region) {
    std::lock_guard<std::mutex> lock(mappings_mu_);
    if (mappings_.size() >= kMaxRegionsPerPeer) {
      return absl::DataLossError(absl::StrCat("SHM_REGION ", region.region_id, ": the peer shared more than ",
                                              kMaxRegionsPerPeer, " regions, the most one peer may"));
    }
    return ProcessMappedBytes().Reserve(peer_name(), mapped_bytes_, region, options().limits);
  }

  // Our regions shared with the peer, by id; guarded by the connection's lock.
  std::unordered_map<uint32_t, std::weak_ptr<MemoryRegion>> shared_regions_;
  std::mutex mappings_mu_;
  std::unordered_map<uint32_t, std::shared_ptr<const Mapping>> mappings_;
  uint64_t mapped_bytes_ = 0;  // sum of the mapped regions' sizes; guarded by mappings_mu_
};

sockaddr_un AbstractAddress(const std::string& name, socklen_t* length) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  // A leading NUL puts the name in the abstract namespace: no file to clean up, gone with the process.
  std::memcpy(address.sun_path + 1, name.data(), std::min(name.size(), sizeof(address.sun_path) - 2));
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return address;
}

class ShmTransport : public StreamTransport {
 public:
  explicit ShmTransport(const TransportOptions& options) : StreamTransport(Backend::kShm, options) {}

  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateRegion(size_t bytes) override {
    const int fd = memfd_create("tf_rdma-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return absl::UnavailableError(ErrnoMessage("memfd_create", errno));
    const size_t length = std::max<size_t>(bytes, 1);
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 || fcntl(fd, F_ADD_SEALS, kRequiredSeals) != 0) {
      const int error = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot size a shared region of ", bytes, " bytes: ", std::strerror(error)));
    }
    void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      const int error = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map a shared region of ", bytes, " bytes: ", std::strerror(error)));
    }
    return std::make_shared<SharedRegion>(next_region_id_++, static_cast<char*>(data), bytes, fd);
  }

 protected:
  absl::StatusOr<int> OpenListeningSocket(const Endpoint& endpoint, Endpoint* bound) override {
    // Port 0 asks for any free name, as it does for TCP.
    std::mt19937 random(std::random_device{}());
    for (int attempt = 0; attempt < 64; ++attempt) {
      const uint16_t port = endpoint.port != 0 ? endpoint.port
                                               : static_cast<uint16_t>(20000 + random() % 40000);
      const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return absl::UnavailableError(ErrnoMessage("socket", errno));
      socklen_t length;
      sockaddr_un address = AbstractAddress(ShmSocketName(port), &length);
      if (bind(fd, reinterpret_cast<sockaddr*>(&address), length) == 0 && listen(fd, SOMAXCONN) == 0) {
        *bound = Endpoint{endpoint.host.empty() ? "127.0.0.1" : endpoint.host, port};
        return fd;
      }
      const int error = errno;
      close(fd);
      if (endpoint.port != 0 || error != EADDRINUSE) {
        return absl::UnavailableError(absl::StrCat("cannot listen on shm endpoint ",
                                                   endpoint.ToString(), ": ", std::strerror(error)));
      }
    }
    return absl::UnavailableError("no free shm endpoint found");
  }

  absl::StatusOr<int> ConnectSocket(const Endpoint& endpoint) override {
    absl::StatusOr<bool> local = IsLocalHost(endpoint.host);
    if (!local.ok()) return local.status();
    if (!*local) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the shm backend reaches only peers on this host, and ", endpoint.host,
          " is not one of its addresses; use TF_RDMA_BACKEND=auto, tcp or verbs"));
    }
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::UnavailableError(ErrnoMessage("socket", errno));
    socklen_t length;
    sockaddr_un address = AbstractAddress(ShmSocketName(endpoint.port), &length);
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), length) != 0) {
      const int error = errno;
      close(fd);
      return absl::UnavailableError(ErrnoMessage("connect", error));
    }
    return fd;
  }

  std::shared_ptr<StreamConnection> MakeConnection(int fd, const PeerIdentity& peer,
                                                   const std::string& peer_address) override {
    return NewShmConnection(fd, peer, peer_address, options());
  }

 private:
  std::atomic<uint32_t> next_region_id_{1};
};

}  // namespace

std::string ShmSocketName(uint16_t port) { return absl::StrCat("tf_rdma-shm-", port); }

absl::Status ShmAvailable() {
  const int fd = memfd_create("tf_rdma-probe", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::UnimplementedError(absl::StrCat("memfd_create fails: ", std::strerror(errno)));
  close(fd);
  return absl::OkStatus();
}

std::unique_ptr<Transport> CreateShmTransport(const TransportOptions& options) {
  return std::make_unique<ShmTransport>(options);
}

std::shared_ptr<StreamConnection> NewShmConnection(int fd, const PeerIdentity& peer,
                                                   const std::string& peer_address,
                                                   const TransportOptions& options) {
  return std::make_shared<ShmConnection>(fd, Backend::kShm, peer, peer_address, options);
}

}  // namespace tf_rdma
