// Messages this task withdrew, per peer task (their step was aborted or ended, or their write
// failed): the peer's connection drops them (Connection::Withdraw), answering the peer's grants
// under them with why. So does the peer's next connection: a peer that was frozen past the peer
// timeout and runs again grants anew over a new connection, which the step's own withdrawal (on the
// connection it wrote on) never reaches.
#ifndef TF_RDMA_CC_TF_RUNTIME_WITHDRAWN_MESSAGES_H_
#define TF_RDMA_CC_TF_RUNTIME_WITHDRAWN_MESSAGES_H_

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

class WithdrawnMessages {
 public:
  // The last kWithdrawnTagsPerPeer tags are remembered per peer; tags name one step's transfer, so no
  // later step's is touched.
  void Withdraw(const std::string& peer_task, const std::vector<Tag>& tags, const absl::Status& why);
  // `connection` is now the one to `peer_task`: drops the messages withdrawn lately on it. Its caller
  // may hold a lock a closing connection's callbacks take: a connection just made has no writes yet,
  // so dropping runs no callback.
  void Adopt(const std::string& peer_task, const std::shared_ptr<Connection>& connection);

 private:
  struct Peer {
    // The tags of messages withdrawn lately, oldest first, and why: a status copy shares its
    // message, so a step's tags hold one between them.
    std::deque<std::pair<Tag, absl::Status>> tags;
    std::weak_ptr<Connection> connection;  // the peer's, as Adopt made it
  };

  // Taken by the callbacks of a closing connection, which withdraw messages: so apart from the lock
  // that retires connections, and after it when both are held.
  std::mutex mu_;
  std::unordered_map<std::string, Peer> peers_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_WITHDRAWN_MESSAGES_H_
