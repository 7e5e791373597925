// Receive buffers planned from static shapes (the MSRA design: the sender writes into a
// destination sized in advance, so even an edge's first transfer needs no regrant).
//
// Where the pass that labels transfers runs (POST_PARTITIONING), each process sees only its own
// partitions in TF1, and a _Recv says nothing about the shape it will receive. So a pass on the
// whole placed graph, before partitioning (POST_REWRITE_FOR_EXEC: the TF1 master, the process that
// instantiates a TF2 multi-device function), infers shapes and records, on each node that consumes
// a tensor from another task, the byte size of that input. The partitioner copies nodes with their
// attributes into the receiving partition, where the consumer of a _Recv then tells its size.
#ifndef TF_RDMA_CC_TF_GRAPH_BUFFER_PLAN_H_
#define TF_RDMA_CC_TF_GRAPH_BUFFER_PLAN_H_

#include <cstdint>
#include <optional>

#include "tensorflow/core/graph/graph.h"

namespace tf_rdma {

// The planned byte size of what `recv` receives, when the whole-graph pass recorded it.
std::optional<int64_t> PlannedBytes(const tensorflow::Node& recv);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_GRAPH_BUFFER_PLAN_H_
