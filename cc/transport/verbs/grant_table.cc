#include "cc/transport/verbs/grant_table.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"

namespace tf_rdma::verbs {
namespace {

// The most slots a peer's table may claim: bounds what announcing it makes us allocate.
constexpr uint32_t kMaxPeerGrantSlots = 1 << 16;

std::atomic<uint64_t> grants_written{0};
std::atomic<uint64_t> grants_read{0};

}  // namespace

GrantTableStats GetGrantTableStats() {
  return {grants_written.load(), grants_read.load()};
}

GrantTables::~GrantTables() {
  local_registration_.reset();
  if (local_ != nullptr) munmap(local_, kBytes);
}

absl::Status GrantTables::Allocate(ibv_pd* pd, int access) {
  void* pages = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (pages == MAP_FAILED) return absl::ResourceExhaustedError("cannot allocate message buffers");
  local_ = static_cast<char*>(pages);
  auto registration = Registration::Create(pd, local_, kBytes, access, "grant table");
  if (!registration.ok()) return registration.status();
  local_registration_ = *std::move(registration);
  return absl::OkStatus();
}

GrantTableMessage GrantTables::Announcement(uint32_t rkey) const {
  return {kSlots, rkey, reinterpret_cast<uint64_t>(local_)};
}

absl::StatusOr<wire::Grant> GrantTables::Read(uint32_t slot, uint32_t length) {
  if (slot >= kSlots || length > kGrantSlotSize) {
    return absl::DataLossError(absl::StrCat("grant record of ", length, " bytes in slot ", slot,
                                            " of a grant table of ", kSlots, " slots of ", kGrantSlotSize,
                                            " bytes"));
  }
  // Copied first: a broken peer may be writing the slot again while it is checked.
  const std::string record(local_ + slot * kGrantSlotSize, length);
  absl::StatusOr<wire::Grant> grant = DecodeGrantRecord(record);
  if (!grant.ok()) {
    return absl::DataLossError(absl::StrCat("grant table slot ", slot, ": ", grant.status().message()));
  }
  grants_read++;
  return grant;
}

absl::Status GrantTables::OnPeerTable(const GrantTableMessage& table) {
  if (peer_) return absl::DataLossError("grant table announced twice");
  if (table.slots == 0 || table.slots > kMaxPeerGrantSlots) {
    return absl::DataLossError(absl::StrCat("grant table of ", table.slots, " slots"));
  }
  const uint64_t size = uint64_t{table.slots} * kGrantSlotSize;
  if (table.address + size < table.address) return absl::DataLossError("grant table wraps around");
  peer_ = PeerTable{table.address, table.rkey};
  for (uint32_t slot = table.slots; slot > 0; --slot) free_peer_slots_.push_back(slot - 1);
  return absl::OkStatus();
}

bool GrantTables::Unqueue(uint64_t grant_id) {
  auto unwritten = std::find_if(unwritten_.begin(), unwritten_.end(),
                                [&](const wire::Grant& grant) { return grant.grant_id == grant_id; });
  if (unwritten == unwritten_.end()) return false;
  unwritten_.erase(unwritten);
  return true;
}

std::optional<GrantTables::SlotWrite> GrantTables::NextWrite() const {
  if (unwritten_.empty() || free_peer_slots_.empty()) return std::nullopt;
  return SlotWrite{unwritten_.front(), free_peer_slots_.back()};
}

void GrantTables::Wrote() {
  written_slots_.emplace(unwritten_.front().grant_id, free_peer_slots_.back());
  free_peer_slots_.pop_back();
  unwritten_.pop_front();
  grants_written++;
}

void GrantTables::Release(uint64_t grant_id) {
  free_peer_slots_.push_back(written_slots_.at(grant_id));
  written_slots_.erase(grant_id);
}

}  // namespace tf_rdma::verbs
