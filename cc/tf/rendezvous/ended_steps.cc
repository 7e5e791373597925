#include "cc/tf/rendezvous/ended_steps.h"

#include <utility>

namespace tf_rdma {

void EndedSteps::Started(int64_t step_id, RdmaRemoteRendezvous* rendezvous) {
  // A rendezvous that goes while its step is listed (nobody cleans the step up: eager steps, a
  // dead owner) takes its entry along. The notice comes on the thread that drops the last
  // reference, which is never done under mu_ (see TakeOverdue).
  auto forget = [steps = weak_from_this(), step_id, rendezvous] {
    if (std::shared_ptr<EndedSteps> alive = steps.lock()) alive->Forget(step_id, rendezvous);
  };
  std::lock_guard<std::mutex> lock(mu_);
  live_.insert_or_assign(step_id, Live{tsl::core::WeakPtr<RdmaRemoteRendezvous>(rendezvous, forget), rendezvous});
}

bool EndedSteps::Ended(int64_t step_id) {
  tsl::core::RefCountPtr<RdmaRemoteRendezvous> rendezvous;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(step_id);
    if (it == live_.end()) return false;
    rendezvous = it->second.rendezvous.GetNewRef();
    live_.erase(it);
  }
  if (!rendezvous || rendezvous->End()) return false;
  tsl::core::WeakPtr<RdmaRemoteRendezvous> weak(rendezvous.get());
  rendezvous.reset();  // maybe the last reference: outside mu_
  if (weak.GetNewRef() == nullptr) return false;
  std::lock_guard<std::mutex> lock(mu_);
  held_.push_back(Held{step_id, std::move(weak), std::chrono::steady_clock::now() + kGrace});
  return true;
}

std::vector<int64_t> EndedSteps::TakeOverdue() {
  std::vector<int64_t> overdue;
  std::vector<tsl::core::RefCountPtr<RdmaRemoteRendezvous>> released_outside_lock;
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  while (!held_.empty()) {
    tsl::core::RefCountPtr<RdmaRemoteRendezvous> rendezvous = held_.front().rendezvous.GetNewRef();
    const bool alive = rendezvous != nullptr;
    released_outside_lock.push_back(std::move(rendezvous));
    if (alive && held_.front().deadline > now) break;
    if (alive) overdue.push_back(held_.front().step_id);
    held_.pop_front();
  }
  return overdue;
}

void EndedSteps::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  live_.clear();
  held_.clear();
}

void EndedSteps::Forget(int64_t step_id, const RdmaRemoteRendezvous* gone) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(step_id);
  if (it != live_.end() && it->second.identity == gone) live_.erase(it);
}

}  // namespace tf_rdma
