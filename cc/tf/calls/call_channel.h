// Control calls between two tasks over their tf_rdma connection (the message format:
// cc/tf/messages/call_message.h). A CallClient makes calls; the CallServer on the other side takes
// them from its request slots and hands each to the server's ServeCall. Either side may call the
// other over the same connection. Nothing here knows TensorFlow: methods are numbers, requests and
// replies bytes.
//
// What a caller is promised: its ReplyDone runs exactly once, with the reply, or with
// kUnavailable naming the peer when the connection ends first (a peer dead or silent past
// TF_RDMA_PEER_TIMEOUT_MS fails it), or with the status given to Cancel.
#ifndef TF_RDMA_CC_TF_CALLS_CALL_CHANNEL_H_
#define TF_RDMA_CC_TF_CALLS_CALL_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/tf/messages/call_message.h"
#include "cc/tf/runtime/buffer_pool.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

// What a peer's calls may make the serving side spend.
struct CallLimits {
  // A request's or a reply's payload, and what the requests one peer has in flight here hold at
  // once (TF_RDMA_MAX_CALL_BYTES); past it a call is answered with kResourceExhausted.
  uint64_t max_payload_bytes = 1ull << 30;
  // Calls one peer has in flight here at once (TF_RDMA_MAX_CALLS_PER_PEER); past it a call is
  // answered with kResourceExhausted. A peer that leaves as many such answers unread (it grants
  // them no memory) has its connection closed.
  size_t max_calls_in_flight = 1024;
};

class CallServer;

// One call being served.
class ServedCall {
 public:
  ServedCall(std::shared_ptr<CallServer> server, uint8_t method, uint64_t call_id, std::string request)
      : server_(std::move(server)), method_(method), call_id_(call_id), request_(std::move(request)) {}

  uint8_t method() const { return method_; }
  const std::string& request() const { return request_; }
  // The caller's name, as its connection's handshake proved it.
  const std::string& peer_name() const;
  // The same for every call that came on one connection, another for each other connection.
  uintptr_t connection_key() const { return reinterpret_cast<uintptr_t>(server_.get()); }
  // `cancel` runs once when the caller gives the call up or its connection ends, at once if that
  // happened already; not after Reply.
  void SetCancelCallback(std::function<void()> cancel);
  // Sends the reply; once. After a cancellation it goes nowhere.
  void Reply(const absl::Status& status, std::string_view payload);

 private:
  friend class CallServer;
  void Cancel();

  const std::shared_ptr<CallServer> server_;
  const uint8_t method_;
  const uint64_t call_id_;
  const std::string request_;
  std::mutex mu_;
  bool cancelled_ = false;
  bool replied_ = false;
  std::function<void()> cancel_;
};

// Runs on a transport thread: it must not block (hand the call to a thread of your own).
using ServeCall = std::function<void(std::shared_ptr<ServedCall>)>;

// The serving side of one connection. Lives while its request slots are granted, that is until the
// connection ends.
class CallServer : public std::enable_shared_from_this<CallServer> {
 public:
  static constexpr int kRequestSlots = 4;

  // Grants the request slots, in a region of their own from `transport`; `pool` gives the memory
  // for requests too large for a slot.
  static absl::Status Start(std::shared_ptr<Connection> connection, Transport& transport,
                            std::shared_ptr<BufferPool> pool, CallLimits limits, ServeCall serve);

  CallServer(std::shared_ptr<Connection> connection, std::shared_ptr<MemoryRegion> slots,
             std::shared_ptr<BufferPool> pool, CallLimits limits, ServeCall serve)
      : connection_(std::move(connection)), slots_(std::move(slots)), pool_(std::move(pool)), limits_(limits),
        serve_(std::move(serve)) {}

 private:
  friend class ServedCall;
  void GrantSlot(int slot);
  void OnRequest(int slot, const GrantResult& result);
  void OnCallRequest(const CallRequestHeader& header, std::string inline_payload);
  void OnBody(const CallRequestHeader& header, const GrantResult& result, const PoolBuffer& body);
  void Serve(uint8_t method, uint64_t call_id, std::string request);
  // The reply of an admitted call; its id is forgotten once the reply is written.
  void SendReply(uint64_t call_id, const absl::Status& status, std::string_view payload);
  // Answers a call that was not admitted with `why`.
  void Decline(uint64_t call_id, const absl::Status& why);
  // The call's reply was written, or it ended otherwise: its id is free.
  void Forget(uint64_t call_id);
  // The peer broke the protocol: the connection ends, naming what it sent.
  void Refuse(const absl::Status& why);
  // The connection ended: every call in flight is cancelled.
  void End();

  const std::shared_ptr<Connection> connection_;
  const std::shared_ptr<MemoryRegion> slots_;
  const std::shared_ptr<BufferPool> pool_;
  const CallLimits limits_;
  const ServeCall serve_;
  std::mutex mu_;
  bool ended_ = false;
  struct Admitted {
    std::shared_ptr<ServedCall> call;  // null while its request's body is on its way
    uint64_t body_bytes = 0;           // of a request that did not fit its slot
  };
  // Calls from their request to their reply's write completing (or the connection's end).
  std::unordered_map<uint64_t, Admitted> calls_;
  uint64_t body_bytes_ = 0;      // the admitted calls' body_bytes
  size_t declines_unread_ = 0;   // Decline's answers not yet written
};

class CallClient;

// One call made: it can be given up.
class OutgoingCall : public std::enable_shared_from_this<OutgoingCall> {
 public:
  using ReplyDone = std::function<void(const absl::Status& status, std::string_view reply)>;

  // The call ends now with `why` (kCancelled, kDeadlineExceeded) unless its reply came first; the
  // serving side is told, and cancels its work.
  void Cancel(const absl::Status& why);

  OutgoingCall(std::shared_ptr<CallClient> client, uint8_t method, uint64_t call_id, ReplyDone done)
      : client_(std::move(client)), method_(method), call_id_(call_id), done_(std::move(done)) {}

 private:
  friend class CallClient;
  void Send(std::string request);
  void GrantReply(uint64_t capacity);
  void OnReply(const GrantResult& result, const PoolBuffer& buffer);
  void OnWritten(const absl::Status& status);
  // Runs done_ once with `status` and `reply`; false if it ran already.
  bool Finish(const absl::Status& status, std::string_view reply);

  const std::shared_ptr<CallClient> client_;
  const uint8_t method_;
  const uint64_t call_id_;
  std::mutex mu_;
  ReplyDone done_;  // empty once run
  uint64_t reply_grant_ = 0;
  bool body_sent_ = false;
};

// The calling side of one connection.
class CallClient : public std::enable_shared_from_this<CallClient> {
 public:
  CallClient(std::shared_ptr<Connection> connection, std::shared_ptr<BufferPool> pool, CallLimits limits)
      : connection_(std::move(connection)), pool_(std::move(pool)), limits_(limits) {}

  // Sends `request` to the serving side's `method`; `done` runs once (see the top of this file),
  // on a transport thread or inside Call.
  std::shared_ptr<OutgoingCall> Call(uint8_t method, std::string request, OutgoingCall::ReplyDone done);

  const std::shared_ptr<Connection>& connection() const { return connection_; }

 private:
  friend class OutgoingCall;
  // How a failure of the connection reaches a caller: kUnavailable, naming the peer.
  absl::Status Unreachable(const absl::Status& cause) const;
  // The reply grant's first size: the largest reply this method had, at least a request slot.
  uint64_t FirstReplyBytes(uint8_t method) const;
  void LearnReplyBytes(uint8_t method, uint64_t bytes);

  const std::shared_ptr<Connection> connection_;
  const std::shared_ptr<BufferPool> pool_;
  const CallLimits limits_;
  std::atomic<uint64_t> next_call_id_{1};
  std::atomic<uint64_t> reply_bytes_[256] = {};
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_CALL_CHANNEL_H_
