// One TensorFlow server's side of tf_rdma: where the other tasks' tf_rdma listeners are, one
// connection per pair of tasks, a receive pool per connection, sizes learned per transfer, and stats.
// Each tf_rdma server (cc/tf/server/) owns one, so several servers in one process each have their
// own endpoint; the rendezvous and collective transports ask it for connections and buffers.
#ifndef TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_
#define TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cc/tf/runtime/buffer_pool.h"
#include "cc/transport/backend_selection.h"
#include "cc/tf/runtime/stats.h"
#include "cc/transport/config.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

struct TaskAddress {
  std::string task;  // "/job:worker/replica:0/task:1"
  std::string host;
  uint16_t grpc_port = 0;
  uint16_t rdma_port = 0;  // 0 only for this task when its server asked for any free port
};

struct RuntimeOptions {
  std::string local_task;
  std::vector<TaskAddress> tasks;  // must include local_task
  Config config;
  // Bounds of the slabs a peer's receive pool grows by (BufferPool).
  uint64_t min_slab_bytes = 1ull << 20;
  uint64_t max_slab_bytes = 64ull << 20;
  // Set for a server that anyone holding the cluster key may use (a tf.data service worker): every
  // accepted connection goes to it, whatever name its peer claims, instead of the task pairing rules.
  // The key comes from TF_RDMA_SECRET alone (TransportOptions::cluster_key), so any process given
  // that secret may, whether or not the cluster names it.
  AcceptCallback serve_any_peer;
};

class Runtime {
 public:
  // Listens for this task's peers, registers the runtime for stats() and starts its one thread
  // that frees the receive pools' idle regions. Fails if the listener cannot bind (e.g. the port
  // is taken by another process).
  static absl::StatusOr<std::shared_ptr<Runtime>> Start(const RuntimeOptions& options);
  // Every runtime started in this process, in start order (they live until the process exits:
  // TensorFlow servers are never torn down, and transfers may run until then).
  static std::vector<std::shared_ptr<Runtime>> Running();

  ~Runtime();

  const std::string& local_task() const { return options_.local_task; }
  // The port every backend's listener took (the one asked for, or the first free one if 0).
  uint16_t port() const { return port_; }
  const Config& config() const { return options_.config; }
  // Adds or updates tasks (a session or an eager context may bring a cluster of a different shape:
  // a client job, a renamed job). A task whose address changed loses its old connection.
  void UpdateTasks(const std::vector<TaskAddress>& tasks);

  // The connection to `peer_task`, established on first use; `done` runs on a runtime or
  // transport thread. The task with the smaller name connects, the other accepts, so each pair
  // shares one connection for both directions.
  using ConnectionCallback = std::function<void(absl::StatusOr<std::shared_ptr<Connection>>)>;
  void WithConnection(const std::string& peer_task, ConnectionCallback done);

  // This task gave up its messages to `peer_task` under `tags` for `why` (their step was aborted
  // or ended, or their write failed): the peer's connection drops them (Connection::DropWrites),
  // answering the peer's grants under them with why. So does the peer's next connection: a peer
  // that was frozen past the peer timeout and runs again grants anew over a new connection, which
  // the step's own withdrawal (on the connection it wrote on) never reaches. The last
  // kGivenUpTagsPerPeer tags are remembered per peer; tags name one step's transfer, so no later
  // step's is touched.
  void GiveUp(const std::string& peer_task, const std::vector<Tag>& tags, const absl::Status& why);

  // A connection to the tf_rdma listener at `address` whoever serves it (a tf.data service worker,
  // known by address alone). One attempt: the caller got the address from a server already up.
  // Not shared: the caller owns it.
  absl::StatusOr<std::shared_ptr<Connection>> Dial(const Endpoint& address);

  // Whether `peer_task` names the server of another task (a session or eager context renamed it):
  // known once WithConnection reported it, and from then on at once.
  bool Renamed(const std::string& peer_task) const;

  // Where tensors from the peer at the other end of `connection` land. Its regions are granted to
  // that connection alone, so a faulty or hostile peer can write nowhere but into the tensors it
  // sends us (received tensors are never reused as other ops' outputs: PoolTensorBuffer). Once the
  // connection is replaced, its pool is retired: no new buffer comes from it, and its regions go
  // (on verbs, deregistered) when the last tensor received into them is dropped. A live pool's
  // regions go once idle for TF_RDMA_RECEIVE_POOL_IDLE_MS (BufferPool::ReleaseIdle).
  absl::StatusOr<std::shared_ptr<BufferPool>> PoolFor(const std::shared_ptr<Connection>& connection);
  // Per backend, what the live connections' receive pools hold and what is lent out now
  // (received tensors alias pool buffers until TensorFlow drops them).
  std::map<Backend, BufferPool::Usage> PoolUsage() const;
  Stats& stats() { return stats_; }

  // What a transfer (named without its step) carried last time, so a steady shape needs one grant;
  // 0 when unknown. Bounded: a program with unbounded distinct transfers forgets old ones.
  uint64_t ExpectedBytes(const std::string& transfer) const;
  void Learn(const std::string& transfer, uint64_t bytes);

 private:
  struct Peer {
    TaskAddress address;
    bool address_known = false;
    // Once connected, a peer whose TensorFlow and tf_rdma ports both stop answering has died: a
    // new connection fails at once instead of waiting TF_RDMA_CONNECT_TIMEOUT_MS, as for a peer
    // that may still be starting.
    bool was_connected = false;
    std::shared_ptr<Connection> connection;
    bool connecting = false;
    std::vector<ConnectionCallback> waiters;
    // Set when the tf_rdma server at the address of this task name turned out to be another task's:
    // the cluster that named it renames tasks, and transfers with it stay on gRPC.
    std::string served_by;
    // The live connection a dial claiming this name was last told to wait for (logged once each).
    const Connection* wait_logged_for = nullptr;
  };
  // What GiveUp keeps per peer task.
  struct GivenUp {
    // The tags of messages given up lately, oldest first, and why: a status copy shares its
    // message, so a step's tags hold one between them.
    std::deque<std::pair<Tag, absl::Status>> tags;
    std::weak_ptr<Connection> connection;  // the peer's, as AdoptLocked made it
  };

  explicit Runtime(RuntimeOptions options);
  absl::Status Listen();
  absl::StatusOr<Transport*> TransportFor(Backend backend);
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
  void Establish(const std::string& peer_task);
  absl::StatusOr<std::shared_ptr<Connection>> ConnectTo(const TaskAddress& peer);
  absl::StatusOr<std::shared_ptr<Connection>> AwaitFrom(const std::string& peer_task);
  absl::Status DiagnoseMissingPeer(const TaskAddress& peer, const absl::Status& cause) const;
  bool WasConnected(const std::string& peer_task) const;
  // The task name the tf_rdma server at `peer`'s address was started as (one handshake).
  absl::StatusOr<std::string> IdentityAt(const TaskAddress& peer);
  // The transport of the backend chosen for `peer`'s host, and why that backend.
  absl::StatusOr<std::pair<Transport*, BackendChoice>> TransportTo(const TaskAddress& peer);
  // Records that `peer`'s name is the tf_rdma server of task `identity`, warns, and returns the
  // error that sends transfers with it to gRPC. Holds mu_.
  absl::Status MarkRenamedLocked(const TaskAddress& peer, const std::string& identity);
  // Makes `connection` the one to `peer_task` (`peer`), which drops the messages given up lately
  // (GiveUp). Holds mu_: a connection just made has no writes yet, so dropping runs no callback.
  void AdoptLocked(const std::string& peer_task, Peer& peer, std::shared_ptr<Connection> connection);
  // Ends `connection` for `reason` and retires its receive pool. Holds mu_.
  // Dials `peer_task`, which sorts after this task and connected to ask who serves this address
  // (it waits for this task's dial), unless a connection to it is alive or being made.
  void DialBackLocked(const std::string& peer_task);
  // Starts Establish(peer_task) on a thread of its own, marking the peer as connecting; an error
  // if no thread can be started.
  absl::Status StartEstablishingLocked(const std::string& peer_task, Peer& peer);
  void RetireLocked(const std::shared_ptr<Connection>& connection, const absl::Status& reason);
  // The idle-region thread: one per runtime, whatever the number of peers, since a pool whose
  // peer went quiet is called by nothing else. It checks every pool a few times per idle period.
  void ReleaseIdleRegions();

  const RuntimeOptions options_;
  mutable std::mutex mu_;
  std::condition_variable accepted_;
  std::map<Backend, std::unique_ptr<Transport>> transports_;
  struct ConnectionPool {
    std::weak_ptr<Connection> connection;
    Backend backend;
    std::shared_ptr<BufferPool> pool;
  };
  std::unordered_map<const Connection*, ConnectionPool> pools_;
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::map<std::string, Peer> peers_;
  // Apart from mu_, which a closing connection's callbacks may find held (RetireLocked), and they
  // give messages up. Taken after mu_ when both are held.
  std::mutex given_up_mu_;
  std::unordered_map<std::string, GivenUp> given_up_;
  std::unordered_map<std::string, uint64_t> learned_bytes_;
  uint16_t port_ = 0;
  Stats stats_;
  bool stopping_ = false;  // guarded by mu_
  std::condition_variable stop_;
  std::thread idle_region_releaser_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_RUNTIME_H_
