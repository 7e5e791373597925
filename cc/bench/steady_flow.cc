#include "cc/bench/steady_flow.h"

#include "absl/strings/str_cat.h"

namespace tf_rdma::bench {

struct SteadyFlow::State : std::enable_shared_from_this<State> {
  struct Peer {
    std::shared_ptr<Connection> connection;
    std::atomic<uint64_t> bytes{0};
    // Grants or writes to issue, and whether a thread is issuing them: a write that completes
    // inside Write (sent at once) asks for the next one from within that call, and issuing it
    // there would recurse once per message.
    std::atomic<int> owed{0};
    std::atomic<bool> issuing{false};
  };

  Side side;
  std::vector<Peer> peers;
  std::vector<std::shared_ptr<MemoryRegion>> regions;  // receiving: one per connection
  std::vector<char> source;  // what every write sends
  uint64_t size = 0;
  std::atomic<bool> stopping{false};

  std::mutex mu;
  std::condition_variable cv;
  uint64_t outstanding = 0;  // guarded by mu
  absl::Status error;        // guarded by mu

  void Owe(size_t i) {
    Peer& peer = peers[i];
    peer.owed.fetch_add(1);
    while (!peer.issuing.exchange(true)) {
      while (!stopping.load() && peer.owed.load() > 0) {
        peer.owed.fetch_sub(1);
        Issue(i);
      }
      peer.issuing.store(false);
      if (stopping.load() || peer.owed.load() == 0) break;
    }
  }

  void Issue(size_t i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++outstanding;
    }
    Connection& connection = *peers[i].connection;
    std::shared_ptr<State> self = shared_from_this();
    if (side == Side::kReceive) {
      connection.Grant(kSteadyFlowTag, regions[i], 0, size, [self, i](const GrantResult& result) {
        if (result.status.ok()) self->peers[i].bytes.fetch_add(result.length);
        self->Finished(i, result.status);
      });
    } else {
      connection.Write(kSteadyFlowTag, source.data(), size, [self, i](const absl::Status& status) {
        if (status.ok()) self->peers[i].bytes.fetch_add(self->size);
        // Withdrawn by Stop: what it asked for, not a failure.
        self->Finished(i, status == DiscardedWrite() ? absl::OkStatus() : status);
      });
    }
  }

  void Finished(size_t i, const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu);
      --outstanding;
      if (!status.ok() && error.ok()) {
        error = absl::Status(status.code(), absl::StrCat("connection to ", peers[i].connection->peer_name(),
                                                         ": ", status.message()));
      }
      cv.notify_all();
    }
    if (status.ok()) Owe(i);
  }
};

absl::StatusOr<std::unique_ptr<SteadyFlow>> SteadyFlow::Start(
    Side side, std::vector<std::shared_ptr<Connection>> connections,
    std::vector<std::shared_ptr<MemoryRegion>> regions, uint64_t size, int depth) {
  if (depth < 1) return absl::InvalidArgumentError("depth must be at least 1");
  if (side == Side::kReceive) {
    if (regions.size() != connections.size()) {
      return absl::InvalidArgumentError(absl::StrCat("receiving needs a region per connection: ",
                                                     regions.size(), " for ", connections.size()));
    }
    for (const auto& region : regions) {
      if (region == nullptr || region->size() < size) {
        return absl::InvalidArgumentError(absl::StrCat("every region must hold ", size, " bytes"));
      }
    }
  } else if (!regions.empty()) {
    return absl::InvalidArgumentError("sending takes no regions");
  }
  auto state = std::make_shared<State>();
  state->side = side;
  state->peers = std::vector<State::Peer>(connections.size());
  for (size_t i = 0; i < connections.size(); ++i) state->peers[i].connection = std::move(connections[i]);
  state->regions = std::move(regions);
  if (side == Side::kSend) state->source.assign(size, '\x5a');
  state->size = size;
  for (int d = 0; d < depth; ++d) {
    for (size_t i = 0; i < state->peers.size(); ++i) state->Owe(i);
  }
  return std::unique_ptr<SteadyFlow>(new SteadyFlow(std::move(state)));
}

SteadyFlow::~SteadyFlow() { Stop(absl::Seconds(10)).IgnoreError(); }

std::vector<uint64_t> SteadyFlow::Bytes() const {
  std::vector<uint64_t> bytes;
  bytes.reserve(state_->peers.size());
  for (const auto& peer : state_->peers) bytes.push_back(peer.bytes.load());
  return bytes;
}

absl::Status SteadyFlow::Stop(absl::Duration timeout) {
  State& state = *state_;
  state.stopping.store(true);
  if (state.side == Side::kSend) {
    for (auto& peer : state.peers) {
      peer.connection->Withdraw(kSteadyFlowTag, absl::CancelledError("the flow stopped"));
    }
  }
  std::unique_lock<std::mutex> lock(state.mu);
  if (!state.cv.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] { return state.outstanding == 0; })) {
    return absl::DeadlineExceededError(absl::StrCat(
        state.outstanding, state.side == Side::kReceive ? " grants" : " writes",
        " still out ", absl::FormatDuration(timeout), " after the flow stopped",
        state.side == Side::kReceive ? " (are the senders still writing?)" : ""));
  }
  return state.error;
}

}  // namespace tf_rdma::bench
