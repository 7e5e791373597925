#include "cc/tf/data/rdma_data_transfer.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/tf/data/data_transfer_api.h"
#include "cc/tf/data/element_message.h"
#include "cc/tf/profiling/trace_span.h"
#include "cc/tf/runtime/pool_tensor_buffer.h"
#include "cc/tf/runtime/runtime.h"
#include "google/protobuf/descriptor.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/threadpool.h"
#include "xla/tsl/lib/monitoring/collection_registry.h"

namespace tf_rdma {
namespace {

using tensorflow::data::DataTransferClient;
using tensorflow::data::DataTransferServer;
using tensorflow::data::GetElementRequest;
using tensorflow::data::GetElementResult;

// Requests a worker keeps granted per trainer connection: how many of that trainer's reads can be
// in flight at once (TensorFlow's client has one per task it reads from).
constexpr int kRequestGrantsPerConnection = 32;
// Threads a worker answers requests on; a request blocks one while its element is produced.
constexpr int kServingThreads = 32;

std::string ProcessName(const std::string& role) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat("tf.data ", role, " pid ", getpid(), " on ", host);
}

absl::StatusOr<std::shared_ptr<Runtime>> StartRuntime(const std::string& name, uint16_t port,
                                                      AcceptCallback serve_any_peer) {
  absl::StatusOr<Config> config = LoadConfigFromEnvironment();
  if (!config.ok()) return config.status();
  RuntimeOptions options;
  options.local_task = name;
  options.tasks = {TaskAddress{name, "", 0, port}};
  options.config = *config;
  options.serve_any_peer = std::move(serve_any_peer);
  return Runtime::Start(options);
}

// ---------------------------------------------------------------------------------------------
// Worker side.

class RdmaDataTransferServer : public DataTransferServer,
                               public std::enable_shared_from_this<RdmaDataTransferServer> {
 public:
  explicit RdmaDataTransferServer(GetElementT get_element) : get_element_(std::move(get_element)) {}

  absl::Status Start(const tensorflow::data::experimental::WorkerConfig& config) override {
    // A fixed port in data_transfer_address is the one to listen on; a placeholder asks for any.
    uint16_t port = 0;
    const std::string& address = config.data_transfer_address();
    const size_t colon = address.rfind(':');
    int fixed = 0;
    if (colon != std::string::npos && absl::SimpleAtoi(address.substr(colon + 1), &fixed) && fixed > 0 &&
        fixed < 65536) {
      port = static_cast<uint16_t>(fixed);
    }
    absl::StatusOr<std::unique_ptr<google::protobuf::Message>> probe = NewGetElementRequest();
    if (!probe.ok()) return probe.status();
    std::weak_ptr<RdmaDataTransferServer> weak = weak_from_this();
    absl::StatusOr<std::shared_ptr<Runtime>> runtime =
        StartRuntime(ProcessName("worker"), port, [weak](std::shared_ptr<Connection> connection) {
          if (auto self = weak.lock()) self->Serve(std::move(connection));
        });
    if (!runtime.ok()) return runtime.status();
    runtime_ = *runtime;
    threads_ = std::make_unique<tensorflow::thread::ThreadPool>(tensorflow::Env::Default(), "tf_rdma_data",
                                                                kServingThreads);
    LOG(INFO) << absl::StrCat("tf_rdma: tf.data service worker serves elements on port ", runtime_->port());
    return absl::OkStatus();
  }

  int Port() const override { return runtime_ ? runtime_->port() : -1; }

  absl::StatusOr<std::string> GetCompatibilityInfo() const override {
    return std::string("tf_rdma " TF_RDMA_VERSION);
  }

  // TensorFlow hands this to the trainer with the worker's task. With fallback, a read that fails
  // with an error TensorFlow does not retry (any but Unavailable, Aborted, Cancelled) moves the
  // worker to gRPC, which retries a lost worker without end; without it, the error reaches the
  // trainer's iterator. That is how a trainer learns that a worker died (see the client's
  // LostWorker). Falling back when tf_rdma cannot connect at all stays (the creation-time switch).
  bool FallBackToGrpcAtGetElementTime() const override { return false; }

 private:
  // One trainer process's connection: keeps request grants posted, one request buffer each.
  struct Peer {
    std::shared_ptr<Connection> connection;
    std::shared_ptr<BufferPool> pool;
  };

  void Serve(std::shared_ptr<Connection> connection) {
    absl::StatusOr<std::shared_ptr<BufferPool>> pool = runtime_->receive_pools().For(connection);
    if (!pool.ok()) {
      connection->Close(pool.status());
      return;
    }
    auto peer = std::make_shared<Peer>(Peer{std::move(connection), *pool});
    for (int i = 0; i < kRequestGrantsPerConnection; ++i) {
      absl::StatusOr<std::unique_ptr<PoolBuffer>> slot = peer->pool->Allocate(kMaxRequestBytes);
      if (!slot.ok()) {
        peer->connection->Close(slot.status());
        return;
      }
      GrantRequest(peer, std::move(*slot));
    }
  }

  // Grants `slot` for the peer's next request. A slot is granted again only once its answer was
  // written: the request is read from the slot while it is answered, and the peer has at most
  // kRequestGrantsPerConnection requests (and their elements) in the worker at once.
  void GrantRequest(const std::shared_ptr<Peer>& peer, std::shared_ptr<PoolBuffer> slot) {
    std::weak_ptr<RdmaDataTransferServer> weak = weak_from_this();
    peer->connection->Grant(RequestTag(), slot->region(), slot->offset(), kMaxRequestBytes,
                            [weak, peer, slot](const GrantResult& landed) {
                              auto self = weak.lock();
                              if (!self) return;
                              if (landed.status.ok()) {
                                absl::StatusOr<ElementRequest> request = DecodeRequest(slot->data(), landed.length);
                                if (!request.ok()) {
                                  peer->connection->Close(request.status());
                                  return;
                                }
                                self->threads_->Schedule([self, peer, slot, request = *request] {
                                  self->Answer(peer, slot, request);
                                });
                              } else if (absl::IsResourceExhausted(landed.status)) {
                                peer->connection->Close(absl::InvalidArgumentError(absl::StrCat(
                                    "a tf.data request of ", landed.length, " bytes, past the ",
                                    kMaxRequestBytes, " a request may take")));
                              }
                            });
  }

  // `request` points into `slot`, which goes back to the peer once the answer was written.
  void Answer(const std::shared_ptr<Peer>& peer, std::shared_ptr<PoolBuffer> slot, const ElementRequest& request) {
    TraceSpan span = TraceSpan::Start();  // from the request to the element's last write done
    auto result = std::make_shared<GetElementResult>();
    absl::Status status;
    absl::StatusOr<std::unique_ptr<google::protobuf::Message>> message = NewGetElementRequest();
    if (!message.ok()) {
      status = message.status();
    } else if (!(*message)->ParseFromArray(request.serialized_request.data(),
                                           static_cast<int>(request.serialized_request.size()))) {
      status = absl::InvalidArgumentError("the trainer's GetElementRequest does not parse");
    } else {
      status = get_element_(AsGetElementRequest(**message), result.get());
    }
    auto response = std::make_shared<EncodedResponse>(EncodeResponse(status, *result));
    if (!status.ok() || result->end_of_sequence || result->skip) result->components.clear();
    // Writes under different tags may complete in any order (each waits for its own grant): the
    // last to complete counts the element and gives the slot back.
    auto answer = std::make_shared<Answered>();
    answer->span = span;
    answer->writes_left = static_cast<int>(response->separate.size()) + 1;
    answer->bytes = response->header_message.size();
    for (const auto& part : response->separate) answer->bytes += part.length;
    std::weak_ptr<RdmaDataTransferServer> weak = weak_from_this();
    // The tensors' own memory is written; `result` and `response` keep it alive until then.
    auto written = [weak, peer, slot, result, response, answer](const absl::Status& status) {
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(answer->mu);
        if (answer->failure.ok()) answer->failure = status;
      }
      if (answer->writes_left.fetch_sub(1) != 1) return;
      answer->span.End([&] {
        return TransferEvent("tf_rdma tf.data element send", peer->connection->peer_name(),
                             BackendName(peer->connection->backend()), answer->bytes, std::nullopt, answer->failure);
      });
      auto self = weak.lock();
      if (!self) return;
      self->runtime_->stats().Peer(peer->connection->peer_name(), [&](PeerStats& s) {
        if (answer->failure.ok()) {
          s.tensors_sent += result->components.size();
          s.bytes_sent += answer->bytes;
          s.bytes_sent_by_kind[kKindData] += answer->bytes;
        } else if (absl::IsCancelled(answer->failure)) {
          s.sends_discarded++;  // the trainer's read was cancelled: it discarded the element
        } else {
          s.errors++;
        }
      });
      // On a connection that ended, the grant completes at once with its error and nothing follows.
      self->GrantRequest(peer, slot);
    };
    for (const auto& part : response->separate) {
      peer->connection->Write(ResponseTag(request.client_id, request.sequence, part.component + 1), part.data,
                              part.length, written);
    }
    peer->connection->Write(ResponseTag(request.client_id, request.sequence, 0), response->header_message.data(),
                            response->header_message.size(), written);
  }

  // The writes of one answer, as they complete.
  struct Answered {
    TraceSpan span;
    std::atomic<int> writes_left{0};
    uint64_t bytes = 0;
    std::mutex mu;
    absl::Status failure;  // the first write's that failed
  };

  const GetElementT get_element_;
  std::shared_ptr<Runtime> runtime_;
  std::unique_ptr<tensorflow::thread::ThreadPool> threads_;
};

// ---------------------------------------------------------------------------------------------
// Trainer side.

// Every client in this process connects from one runtime (it listens too, though no one dials it).
absl::StatusOr<std::shared_ptr<Runtime>> TrainerRuntime() {
  static std::mutex mu;
  static std::shared_ptr<Runtime>* runtime = new std::shared_ptr<Runtime>();
  std::lock_guard<std::mutex> lock(mu);
  if (*runtime) return *runtime;
  absl::StatusOr<std::shared_ptr<Runtime>> started = StartRuntime(ProcessName("trainer"), 0, nullptr);
  if (!started.ok()) return started.status();
  *runtime = *started;
  return *runtime;
}

uint64_t RandomId() {
  static std::mutex mu;
  static std::mt19937_64 random(std::random_device{}());
  std::lock_guard<std::mutex> lock(mu);
  return random();
}

// A receive range granted for one message of one element.
struct Landing {
  std::shared_ptr<PoolBuffer> buffer;
  uint64_t capacity = 0;
  uint64_t grant_id = 0;
  bool done = false;
  GrantResult result;
};

// Grants of one element: its header message and the components expected to travel on their own.
struct ElementGrants {
  std::shared_ptr<Landing> header;
  std::map<uint32_t, std::shared_ptr<Landing>> components;
};

class RdmaDataTransferClient : public DataTransferClient {
 public:
  RdmaDataTransferClient(std::shared_ptr<Runtime> runtime, Endpoint address)
      : runtime_(std::move(runtime)), address_(std::move(address)), client_id_(RandomId()),
        prefetch_(runtime_->config().data_prefetch_elements) {}

  // TensorFlow makes a client per worker for each iteration and drops it when the iteration ends:
  // its connection ends with it, else a trainer would hold one more per worker every epoch.
  ~RdmaDataTransferClient() override {
    std::lock_guard<std::mutex> lock(mu_);
    RevokeAllLocked();
    if (connection_) connection_->Close(absl::CancelledError("tf_rdma: the trainer's tf.data iteration ended"));
  }

  absl::Status Connect() {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Connection> connection;
    std::shared_ptr<BufferPool> pool;
    return ConnectedLocked(/*coordinated_read=*/false, &connection, &pool);
  }

  absl::Status GetElement(const GetElementRequest& req, GetElementResult& result) override {
    TraceSpan span = TraceSpan::Start();
    ElementRead read;
    absl::Status status = ReadElement(req, result, span.recording() ? &read : nullptr);
    span.End([&] {
      return TransferEvent("tf_rdma tf.data element receive", read.peer, read.backend, read.bytes, std::nullopt,
                           status);
    });
    return status;
  }

  void TryCancel() override {
    // Wakes a read in progress, which gives its grants back; the rest go with the client.
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->cancelled = true;
    state_->changed.notify_all();
  }

 private:
  // What one read reached, for its span in TensorFlow's profiler.
  struct ElementRead {
    std::string peer;
    const char* backend = "none";
    uint64_t bytes = 0;
  };

  // `read`, when a profiler records, learns what the read reached.
  absl::Status ReadElement(const GetElementRequest& req, GetElementResult& result, ElementRead* read) {
    // Grants and revokes are made under mu_ alone: their callbacks, which may run inside those
    // calls (on a connection that failed), take state_->mu.
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Connection> connection;
    std::shared_ptr<BufferPool> pool;
    absl::Status connected = ConnectedLocked(IsCoordinatedRead(req), &connection, &pool);
    if (!connected.ok()) return connected;
    if (read != nullptr) {
      read->peer = connection->peer_name();
      read->backend = BackendName(connection->backend());
    }
    if (Cancelled()) return absl::CancelledError("tf_rdma: the tf.data client was cancelled");
    const uint64_t sequence = next_sequence_++;
    for (uint64_t s = sequence; s <= sequence + prefetch_; ++s) {
      if (!granted_.count(s)) {
        absl::Status posted = GrantElementLocked(*connection, *pool, s);
        if (!posted.ok()) return Fail(connection, posted);
      }
    }
    ElementGrants grants = std::move(granted_[sequence]);
    granted_.erase(sequence);

    const std::string serialized_request = AsMessage(req).SerializeAsString();
    auto request = std::make_shared<std::string>(EncodeRequest(ElementRequest{client_id_, sequence, serialized_request}));
    if (request->size() > kMaxRequestBytes) {
      return absl::InvalidArgumentError(absl::StrCat("a tf.data request of ", request->size(),
                                                     " bytes, past the ", kMaxRequestBytes, " tf_rdma carries"));
    }
    connection->Write(RequestTag(), request->data(), request->size(), [request](const absl::Status&) {});

    absl::Status header_landed =
        AwaitLocked(*connection, *pool, ResponseTag(client_id_, sequence, 0), grants.header, kMaxResponseHeaderBytes);
    if (!header_landed.ok()) return Abandon(connection, sequence, grants, header_landed);
    absl::StatusOr<DecodedResponse> response = DecodeResponse(grants.header->buffer->data(), grants.header->result.length);
    if (!response.ok()) return Fail(connection, response.status());
    // Components granted ahead that travel inline after all, or do not exist: their ranges go back.
    for (auto& [component, landing] : grants.components) {
      if (component >= response->components.size() || !response->components[component].separate) {
        connection->Revoke(landing->grant_id);
      }
    }
    if (!response->status.ok()) return response->status;
    result.end_of_sequence = response->end_of_sequence;
    result.skip = response->skip;
    result.element_index = response->element_index;
    uint64_t bytes = grants.header->result.length;
    std::vector<uint64_t> layout(response->components.size(), 0);
    result.components.clear();
    result.components.reserve(response->components.size());
    for (uint32_t i = 0; i < response->components.size(); ++i) {
      const DecodedResponse::Component& component = response->components[i];
      if (!component.separate) {
        absl::StatusOr<tensorflow::Tensor> tensor = FromBytes(component.header, component.inline_bytes, nullptr);
        if (!tensor.ok()) return Fail(connection, tensor.status());
        result.components.push_back(std::move(*tensor));
        continue;
      }
      std::shared_ptr<Landing>& landing = grants.components[i];
      absl::Status landed = AwaitLocked(*connection, *pool, ResponseTag(client_id_, sequence, i + 1), landing,
                                        component.header.data_bytes);
      if (!landed.ok()) return Abandon(connection, sequence, grants, landed);
      if (landing->result.length != component.header.data_bytes) {
        return Fail(connection, absl::DataLossError(absl::StrCat(
                                    "tf_rdma: component ", i, " of a tf.data element came with ",
                                    landing->result.length, " bytes, its header says ", component.header.data_bytes)));
      }
      absl::StatusOr<tensorflow::Tensor> tensor = FromBytes(
          component.header, std::string_view(landing->buffer->data(), landing->result.length), landing->buffer);
      if (!tensor.ok()) return Fail(connection, tensor.status());
      result.components.push_back(std::move(*tensor));
      layout[i] = component.header.data_bytes;
      bytes += component.header.data_bytes;
    }
    if (!result.end_of_sequence && !result.skip) layout_ = std::move(layout);
    if (read != nullptr) read->bytes = bytes;
    runtime_->stats().Peer(connection->peer_name(), [&](PeerStats& s) {
      s.tensors_received += result.components.size();
      s.bytes_received += bytes;
      s.bytes_received_by_kind[kKindData] += bytes;
    });
    return absl::OkStatus();
  }

  // What grant callbacks share with the client; they may run after it is gone.
  struct State {
    std::mutex mu;
    std::condition_variable changed;
    bool cancelled = false;
  };

  // A round-robin read (num_consumers set) of a worker that keeps failing with Unavailable makes
  // TensorFlow ask its dispatcher to drop the worker's task, and the rounds go on without it: for
  // those reads a lost worker stays Unavailable.
  static bool IsCoordinatedRead(const GetElementRequest& req) {
    const google::protobuf::Message& message = AsMessage(req);
    // Looked up once: every read asks.
    static const google::protobuf::FieldDescriptor* const consumer_index =
        message.GetDescriptor()->FindFieldByName("consumer_index");
    return consumer_index != nullptr && message.GetReflection()->HasField(message, consumer_index);
  }

  absl::Status ConnectedLocked(bool coordinated_read, std::shared_ptr<Connection>* connection,
                               std::shared_ptr<BufferPool>* pool) {
    if (!connection_ || !connection_->health().ok()) {
      absl::StatusOr<std::shared_ptr<Connection>> dialed = runtime_->connections().Dial(address_);
      if (!dialed.ok()) {
        if (connection_ && !coordinated_read) return LostWorker(*connection_, dialed.status());
        // The first connect, as TensorFlow builds the client: it falls back to gRPC for this worker.
        return absl::UnavailableError(absl::StrCat("tf_rdma: the tf.data worker at ", address_.ToString(),
                                                   " is unreachable: ", dialed.status().message()));
      }
      absl::StatusOr<std::shared_ptr<BufferPool>> dialed_pool = runtime_->receive_pools().For(*dialed);
      if (!dialed_pool.ok()) return dialed_pool.status();
      granted_.clear();  // grants of a connection that ended completed with its error
      connection_ = *dialed;
      pool_ = *dialed_pool;
    }
    *connection = connection_;
    *pool = pool_;
    return absl::OkStatus();
  }

  // The worker's connection ended and the worker could not be dialed again for the whole connect
  // timeout (the dial retries that long). TensorFlow 2.21 would retry an Unavailable read of it
  // forever: its dispatcher keeps a lost worker's task, so the task never ends. The error the
  // trainer's iterator gets instead names the worker; its code is one TensorFlow does not retry.
  absl::Status LostWorker(const Connection& ended, const absl::Status& redial) {
    const absl::StatusCode code = absl::IsUnavailable(redial) || absl::IsAborted(redial) || absl::IsCancelled(redial)
                                      ? absl::StatusCode::kDeadlineExceeded
                                      : redial.code();
    return absl::Status(
        code, absl::StrCat("tf_rdma: lost the tf.data worker at ", address_.ToString(), " (", ended.peer_name(),
                           "). TensorFlow keeps a lost worker's task, so this read fails rather than wait for it; "
                           "a worker restarted in place must be back within TF_RDMA_CONNECT_TIMEOUT_MS. Its "
                           "connection ended (", ended.health().message(), "); dialing it again failed: ",
                           redial.message()));
  }

  absl::StatusOr<std::shared_ptr<Landing>> GrantLocked(Connection& connection, BufferPool& pool, const Tag& tag,
                                                      uint64_t capacity) {
    absl::StatusOr<std::unique_ptr<PoolBuffer>> buffer = pool.Allocate(std::max<uint64_t>(capacity, 1));
    if (!buffer.ok()) return buffer.status();
    auto landing = std::make_shared<Landing>();
    landing->buffer = std::move(*buffer);
    landing->capacity = std::max<uint64_t>(capacity, 1);
    std::shared_ptr<State> state = state_;
    landing->grant_id = connection.Grant(tag, landing->buffer->region(), landing->buffer->offset(), landing->capacity,
                                         [state, landing](const GrantResult& result) {
                                           std::lock_guard<std::mutex> lock(state->mu);
                                           landing->done = true;
                                           landing->result = result;
                                           state->changed.notify_all();
                                         });
    runtime_->stats().Peer(connection.peer_name(), [](PeerStats& s) { s.grants++; });
    return landing;
  }

  absl::Status GrantElementLocked(Connection& connection, BufferPool& pool, uint64_t sequence) {
    ElementGrants grants;
    absl::StatusOr<std::shared_ptr<Landing>> header =
        GrantLocked(connection, pool, ResponseTag(client_id_, sequence, 0), kResponseHeaderGrant);
    if (!header.ok()) return header.status();
    grants.header = *header;
    for (uint32_t i = 0; i < layout_.size(); ++i) {
      if (layout_[i] == 0) continue;
      absl::StatusOr<std::shared_ptr<Landing>> component =
          GrantLocked(connection, pool, ResponseTag(client_id_, sequence, i + 1), layout_[i]);
      if (!component.ok()) return component.status();
      grants.components[i] = *component;
    }
    granted_[sequence] = std::move(grants);
    return absl::OkStatus();
  }

  // Waits for `landing` (granting it first if there is none), granting a larger range once when the
  // message outgrew it, up to `most` bytes.
  absl::Status AwaitLocked(Connection& connection, BufferPool& pool, const Tag& tag,
                           std::shared_ptr<Landing>& landing, uint64_t most) {
    while (true) {
      if (!landing) {
        absl::StatusOr<std::shared_ptr<Landing>> granted = GrantLocked(connection, pool, tag, most);
        if (!granted.ok()) return granted.status();
        landing = *granted;
      }
      {
        std::unique_lock<std::mutex> lock(state_->mu);
        state_->changed.wait(lock, [&] { return landing->done || state_->cancelled; });
        if (!landing->done) return absl::CancelledError("tf_rdma: the tf.data client was cancelled");
      }
      if (landing->result.status.ok()) return absl::OkStatus();
      if (!absl::IsResourceExhausted(landing->result.status)) {
        return absl::UnavailableError(absl::StrCat("tf_rdma: receiving a tf.data element from ",
                                                   connection.peer_name(), " failed: ", landing->result.status.message()));
      }
      if (landing->result.length > most) {
        return absl::DataLossError(absl::StrCat("tf_rdma: the tf.data worker ", connection.peer_name(), " sent ",
                                                landing->result.length, " bytes where at most ", most, " may come"));
      }
      most = landing->result.length;
      runtime_->stats().Peer(connection.peer_name(), [](PeerStats& s) { s.regrants++; });
      landing.reset();
    }
  }

  absl::StatusOr<tensorflow::Tensor> FromBytes(const TensorHeader& header, std::string_view bytes,
                                               std::shared_ptr<PoolBuffer> landed) {
    if (!TravelsAsBytes(header.dtype)) return TensorFromProtoBytes(header, bytes);
    if (landed) {
      // The tensor aliases the bytes where they landed.
      auto* storage = new PoolTensorBuffer(std::move(landed), bytes.size());
      tensorflow::Tensor tensor(header.dtype, header.shape, storage);
      storage->Unref();
      return tensor;
    }
    tensorflow::Tensor tensor(header.dtype, header.shape);
    // An empty tensor has no buffer: memcpy's null destination would be undefined even for 0 bytes.
    if (!bytes.empty()) std::memcpy(const_cast<char*>(tensor.tensor_data().data()), bytes.data(), bytes.size());
    return tensor;
  }

  // A failed read: the connection may be wrong from here on, so the next read dials again (and
  // fails for good if the worker is gone, LostWorker). A connection that broke comes back as
  // Unavailable, which TensorFlow retries; other errors reach the trainer's iterator.
  absl::Status Fail(const std::shared_ptr<Connection>& connection, const absl::Status& error) {
    runtime_->stats().Peer(connection->peer_name(), [](PeerStats& s) { s.errors++; });
    RevokeAllLocked();
    connection->Close(error);
    return error;
  }

  bool Cancelled() {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->cancelled;
  }

  // A read that ends before its element arrived (cancelled, or the connection failed): its grants
  // go back, and the worker is told not to write the element's messages. Errors other than a
  // cancel also end the connection, since its messages may be out of step from here on.
  absl::Status Abandon(const std::shared_ptr<Connection>& connection, uint64_t sequence, const ElementGrants& grants,
                       const absl::Status& error) {
    connection->Revoke(grants.header->grant_id);
    for (const auto& [component, landing] : grants.components) {
      if (landing) connection->Revoke(landing->grant_id);
    }
    connection->DiscardPeerWrites(ResponseTag(client_id_, sequence, 0));
    for (uint32_t i = 0; i < layout_.size(); ++i) connection->DiscardPeerWrites(ResponseTag(client_id_, sequence, i + 1));
    if (absl::IsCancelled(error)) {
      RevokeAllLocked();
      return error;
    }
    return Fail(connection, error);
  }

  void RevokeAllLocked() {
    if (connection_) {
      for (auto& [sequence, grants] : granted_) {
        connection_->Revoke(grants.header->grant_id);
        for (auto& [component, landing] : grants.components) connection_->Revoke(landing->grant_id);
      }
    }
    granted_.clear();
  }

  const std::shared_ptr<Runtime> runtime_;
  const Endpoint address_;
  const uint64_t client_id_;
  const int prefetch_;
  std::mutex mu_;  // one read at a time; guards what follows
  std::shared_ptr<Connection> connection_;
  std::shared_ptr<BufferPool> pool_;
  const std::shared_ptr<State> state_ = std::make_shared<State>();
  uint64_t next_sequence_ = 0;
  std::map<uint64_t, ElementGrants> granted_;
  std::vector<uint64_t> layout_;  // bytes of each component that travelled on its own last time
};

struct Registrar {
  Registrar() {
    DataTransferServer::Register(kDataTransferProtocol, [](DataTransferServer::GetElementT get_element,
                                                           std::shared_ptr<DataTransferServer>* out) {
      *out = std::make_shared<RdmaDataTransferServer>(std::move(get_element));
      return absl::OkStatus();
    });
    DataTransferClient::Register(kDataTransferProtocol, [](DataTransferClient::Config config,
                                                           std::unique_ptr<DataTransferClient>* out) {
      absl::StatusOr<Endpoint> address = Endpoint::Parse(config.address);
      if (!address.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("tf_rdma: the tf.data worker's transfer address '",
                                                       config.address, "' is not host:port"));
      }
      absl::StatusOr<std::shared_ptr<Runtime>> runtime = TrainerRuntime();
      if (!runtime.ok()) return runtime.status();
      auto client = std::make_unique<RdmaDataTransferClient>(*runtime, *address);
      // Connecting now lets TensorFlow fall back to gRPC for this worker (and count why) when
      // tf_rdma cannot reach it, instead of failing the first read.
      absl::Status connected = client->Connect();
      if (!connected.ok()) return connected;
      *out = std::move(client);
      return absl::OkStatus();
    });
  }
};
const Registrar registrar;

}  // namespace

std::map<std::string, uint64_t> DataTransferFallbacks() {
  tsl::monitoring::CollectionRegistry::CollectMetricsOptions options;
  options.collect_metric_descriptors = false;
  std::unique_ptr<tsl::monitoring::CollectedMetrics> collected =
      tsl::monitoring::CollectionRegistry::Default()->CollectMetrics(options);
  std::map<std::string, uint64_t> fallbacks;
  auto it = collected->point_set_map.find("/tensorflow/data/service/data_transfer_protocol_fallback");
  if (it == collected->point_set_map.end()) return fallbacks;
  for (const auto& point : it->second->points) {
    std::string protocol;
    std::vector<std::string> why;
    for (const auto& label : point->labels) {
      if (label.name == "data_transfer_protocol") {
        protocol = label.value;
      } else {
        why.push_back(absl::StrCat(label.name, ": ", label.value));
      }
    }
    if (protocol != kDataTransferProtocol || point->int64_value <= 0) continue;
    fallbacks[absl::StrCat("tf.data elements from a worker over gRPC instead of tf_rdma (",
                           absl::StrJoin(why, "; "), ")")] += point->int64_value;
  }
  return fallbacks;
}

}  // namespace tf_rdma
