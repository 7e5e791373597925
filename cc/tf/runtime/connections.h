// One connection per pair of tasks, for both directions: the task with the smaller name connects,
// the other accepts. Made on first use, replaced when it ended (a restarted or once-frozen peer
// connects again), and each one's receive pool retired with it.
#ifndef TF_RDMA_CC_TF_RUNTIME_CONNECTIONS_H_
#define TF_RDMA_CC_TF_RUNTIME_CONNECTIONS_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/tf/runtime/withdrawn_messages.h"
#include "cc/tf/runtime/receive_pools.h"
#include "cc/tf/runtime/stats.h"
#include "cc/tf/runtime/task_addresses.h"
#include "cc/tf/runtime/transports.h"
#include "cc/transport/config.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

class Connections {
 public:
  // `serve_any_peer`, when set, takes every accepted connection, whatever name its peer claims,
  // instead of the task pairing rules (RuntimeOptions::serve_any_peer).
  Connections(const Config& config, AcceptCallback serve_any_peer, TaskAddresses& addresses,
              Transports& transports, ReceivePools& pools, Stats& stats);

  // Listens for this task's peers on every viable backend, at `self`'s tf_rdma port; returns the
  // port every listener took (the one asked for, or the first free one if 0). Fails if a listener
  // cannot bind (e.g. the port is taken by another process).
  absl::StatusOr<uint16_t> Listen(const TaskAddress& self);

  // The connection to `peer_task`, established on first use; `done` runs on a runtime or
  // transport thread. Where the peer is to dial (its name sorts first), this task waits for it,
  // asking it to dial only once an attempt passed (both sides of a transfer need the connection
  // at once, and the peer dials); with kAskPeerToDial, at once (a call: the peer may not need the
  // connection before it answers).
  using ConnectionCallback = std::function<void(absl::StatusOr<std::shared_ptr<Connection>>)>;
  enum class Waiting { kForPeer, kAskPeerToDial };
  void WithConnection(const std::string& peer_task, ConnectionCallback done, Waiting waiting = Waiting::kForPeer);

  // Runs `observer` for every connection this task takes from now on (dialled or accepted, the
  // first to a task or one replacing another), and at once for those it holds. It runs with the
  // connections' lock held: it must not block or call back into Connections.
  using ConnectionObserver = std::function<void(const std::shared_ptr<Connection>&)>;
  void Observe(ConnectionObserver observer);

  // This task withdraws its messages to `peer_task` under `tags` for `why` (WithdrawnMessages).
  void Withdraw(const std::string& peer_task, const std::vector<Tag>& tags, const absl::Status& why);

  // A connection to the tf_rdma listener at `address` whoever serves it (a tf.data service worker,
  // known by address alone). One attempt: the caller got the address from a server already up.
  // Not shared: the caller owns it.
  absl::StatusOr<std::shared_ptr<Connection>> Dial(const Endpoint& address);

  // Ends the connection to `peer_task`, if any, for `reason` (the task moved), and retires its
  // receive pool.
  void Retire(const std::string& peer_task, const absl::Status& reason);

 private:
  struct Peer {
    // Once connected, a peer whose TensorFlow and tf_rdma ports both stop answering has died: a
    // new connection fails at once instead of waiting TF_RDMA_CONNECT_TIMEOUT_MS, as for a peer
    // that may still be starting.
    bool was_connected = false;
    std::shared_ptr<Connection> connection;
    bool connecting = false;
    std::vector<ConnectionCallback> waiters;
    // Calls that came to wait (kAskPeerToDial) since the connection was last made: each asks the
    // peer to dial at once, so that one coming after a frozen peer thawed asks again.
    uint64_t dial_asks = 0;
    // The live connection a dial claiming this name was last told to wait for (logged once each).
    const Connection* wait_logged_for = nullptr;
  };

  // Whether a peer that proved the cluster key under the name `peer` may connect now: the
  // listeners' AdmitCallback, so a refusal reaches the peer as its connect's outcome, which it
  // retries: kUnavailable while the peer's previous connection is alive. Whether that name may
  // connect at all OnAccepted judges, after the handshake (why there: its comment).
  absl::Status Admit(const std::string& peer);
  absl::Status AdmitLocked(const std::string& peer);
  void OnAccepted(std::shared_ptr<Connection> connection);
  // The one place a connection is counted in stats (accepted, connected to a task, or dialled for
  // tf.data), with the backend it runs on and why.
  void RecordConnection(const std::string& peer, Backend backend, const std::string& reason);
  // Dials `peer_task`, which sorts after this task and connected to ask who serves this address
  // (it waits for this task's dial), unless a connection to it is alive or being made. Holds mu_.
  void DialBackLocked(const std::string& peer_task);
  // Starts Establish(peer_task) on a thread of its own, marking the peer as connecting; an error
  // if no thread can be started. Holds mu_.
  absl::Status StartEstablishingLocked(const std::string& peer_task, Peer& peer);
  // Makes `connection` the one to `peer_task` (`peer`), which drops the messages withdrawn lately
  // (Withdraw). Holds mu_.
  void AdoptLocked(const std::string& peer_task, Peer& peer, std::shared_ptr<Connection> connection);
  // Ends `connection` for `reason` and retires its receive pool. Holds mu_.
  void RetireLocked(const std::shared_ptr<Connection>& connection, const absl::Status& reason);

  // How a connection is made (connection_setup.cc).
  void Establish(const std::string& peer_task);
  absl::StatusOr<std::shared_ptr<Connection>> ConnectTo(const TaskAddress& peer);
  absl::StatusOr<std::shared_ptr<Connection>> AwaitFrom(const std::string& peer_task);
  // Before AwaitFrom waits: whether the peer can reach this task over an explicit backend at all.
  absl::Status CheckPeerCanConnect(const std::string& peer_task);
  bool WasConnected(const std::string& peer_task) const;
  // The task name the tf_rdma server at `peer`'s address was started as (one handshake).
  absl::StatusOr<std::string> IdentityAt(const TaskAddress& peer);

  const std::string& local_task_;  // the addresses'
  const Config& config_;  // outlives it (the Runtime's options)
  const AcceptCallback serve_any_peer_;
  TaskAddresses& addresses_;
  Transports& transports_;
  ReceivePools& pools_;
  Stats& stats_;
  WithdrawnMessages withdrawn_;

  mutable std::mutex mu_;
  std::condition_variable accepted_;
  std::map<std::string, Peer> peers_;
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::vector<ConnectionObserver> observers_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_CONNECTIONS_H_
