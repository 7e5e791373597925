#include "cc/tf/calls/call_timer.h"

#include <system_error>

#include "absl/log/log.h"
#include "absl/time/clock.h"

namespace tf_rdma {

CallTimer& CallTimer::Process() {
  static CallTimer* timer = new CallTimer();  // never destroyed: closures may be due at exit
  return *timer;
}

uint64_t CallTimer::At(absl::Time when, std::function<void()> closure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!started_) {
    try {
      std::thread([this] { Run(); }).detach();
      started_ = true;
    } catch (const std::system_error& error) {
      // The process's thread limit: no crash; the closures wait for a later At to start it.
      LOG_EVERY_N_SEC(ERROR, 10) << "tf_rdma: cannot start the thread that ends calls past their deadline "
                                 << "or cancelled: " << error.what() << "; trying again at the next call";
    }
  }
  const uint64_t id = next_id_++;
  const bool earliest = due_.empty() || when < due_.begin()->first.first;
  due_.emplace(std::make_pair(when, id), std::move(closure));
  when_.emplace(id, when);
  if (earliest) changed_.notify_one();
  return id;
}

void CallTimer::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return;
  due_.erase(std::make_pair(it->second, id));
  when_.erase(it);
}

void CallTimer::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (due_.empty()) {
      changed_.wait(lock);
      continue;
    }
    const absl::Time next = due_.begin()->first.first;
    const absl::Time now = absl::Now();
    if (next > now) {
      changed_.wait_for(lock, absl::ToChronoNanoseconds(next - now));
      continue;
    }
    auto first = due_.begin();
    std::function<void()> closure = std::move(first->second);
    when_.erase(first->first.second);
    due_.erase(first);
    lock.unlock();
    closure();
    lock.lock();
  }
}

}  // namespace tf_rdma
