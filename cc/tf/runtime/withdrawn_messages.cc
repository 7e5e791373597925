#include "cc/tf/runtime/withdrawn_messages.h"

#include <algorithm>

namespace tf_rdma {
namespace {

// Messages withdrawn per peer that its next connection still answers: a few steps' worth of a task's
// transfers to one peer, and a few KiB per peer at most.
constexpr size_t kWithdrawnTagsPerPeer = 512;

}  // namespace

void WithdrawnMessages::Withdraw(const std::string& peer_task, const std::vector<Tag>& tags, const absl::Status& why) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_[peer_task];
    for (const Tag& tag : tags) {
      const bool known = std::any_of(peer.tags.begin(), peer.tags.end(),
                                     [&tag](const auto& entry) { return entry.first == tag; });
      if (known) continue;
      peer.tags.emplace_back(tag, why);
      if (peer.tags.size() > kWithdrawnTagsPerPeer) peer.tags.pop_front();
    }
    connection = peer.connection.lock();
  }
  // Unlocked: writes waiting under the tags complete here, and their callbacks may ask for the
  // connection again. A connection adopted after the tags were listed took them from the list.
  if (connection == nullptr) return;
  for (const Tag& tag : tags) connection->Withdraw(tag, why);
}

void WithdrawnMessages::Adopt(const std::string& peer_task, const std::shared_ptr<Connection>& connection) {
  std::deque<std::pair<Tag, absl::Status>> withdrawn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_[peer_task];
    withdrawn = peer.tags;
    peer.connection = connection;
  }
  for (const auto& [tag, why] : withdrawn) connection->Withdraw(tag, why);
}

}  // namespace tf_rdma
