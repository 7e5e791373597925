// The methods control calls name by number (cc/tf/messages/call_message.h carries one byte): the
// worker service's and the eager service's, as TensorFlow's gRPC services define them.
#ifndef TF_RDMA_CC_TF_CALLS_CALL_METHODS_H_
#define TF_RDMA_CC_TF_CALLS_CALL_METHODS_H_

#include <cstdint>

namespace tf_rdma {

enum class WorkerMethod : uint8_t {
  kGetStatus = 1,
  kCreateWorkerSession,
  kDeleteWorkerSession,
  kRegisterGraph,
  kDeregisterGraph,
  kRunGraph,
  kCleanupGraph,
  kCleanupAll,
  kLogging,
  kTracing,
  kCompleteGroup,
  kCompleteInstance,
  kGetStepSequence,
  // tf_rdma's own: the CleanupGraph calls of several steps as one (WorkerCalls::CleanupGraph).
  kCleanupGraphs,
};

// Numbered apart from the worker's, so that either service can grow.
enum class EagerMethod : uint8_t {
  kCreateContext = 64,
  kUpdateContext,
  kEnqueue,
  // EagerService's StreamingEnqueue: the requests of one context's stream, in order.
  kStreamingEnqueue,
  kWaitQueueDone,
  kRunComponentFunction,
  kKeepAlive,
  kCloseContext,
};

inline bool IsEagerMethod(uint8_t number) { return number >= static_cast<uint8_t>(EagerMethod::kCreateContext); }

// The method's name, as stats() counts calls by it ("RunGraph", "StreamingEnqueue"); "unknown" for
// a number no method has.
const char* MethodName(uint8_t number);
inline const char* MethodName(WorkerMethod method) { return MethodName(static_cast<uint8_t>(method)); }
inline const char* MethodName(EagerMethod method) { return MethodName(static_cast<uint8_t>(method)); }

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_CALLS_CALL_METHODS_H_
