// Fusion of a step's small, statically shaped transfers between two devices into one message: one
// grant and one write in a layout planned before the graph runs, instead of a grant and a write per
// tensor (the MSRA paper's planned buffers; TensorFlow's FuseRecv RFC). Many small tensors per step
// are where recommendation models spend their communication, and there the per-message cost rules.
//
// The whole placed graph is seen only before partitioning (the TF1 master, or the process that
// instantiates a TF2 multi-device function), while each partition's _Send and _Recv exist only
// after, possibly in other processes. So the plan is made on the whole graph and recorded on the
// nodes at both ends of each fused transfer, which the partitioner copies into the partitions; after
// partitioning each process renames the _Send or _Recv of a fused transfer, on either side alike, so
// that its rendezvous key carries the plan (fusion group, slot, layout). The rendezvous reads the plan
// off the key: no state is shared between graphs, and a key cannot name another graph's plan.
//
// A fused message leaves when all of its members were sent, so a group never holds a tensor that
// another member waits for: members are chosen so that fusing makes no cycle across the tasks and
// they wait for the same feeds (a partial run feeds call by call), and only graphs without control
// flow (whose every node runs once per step) are fused.
#ifndef TF_RDMA_CC_TF_PLANNING_FUSION_H_
#define TF_RDMA_CC_TF_PLANNING_FUSION_H_

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "tensorflow/core/graph/graph.h"

namespace tf_rdma {

// One transfer's place in its fused message.
struct FusedMember {
  uint64_t group = 0;  // unique to one plan
  uint32_t index = 0;
  uint32_t count = 0;  // members of the group
  uint64_t offset = 0;
  uint64_t capacity = 0;
  uint64_t total = 0;  // bytes of the whole message
};

// The member a transfer's tensor name says it is, if it is fused.
std::optional<FusedMember> ParseFusedMember(std::string_view tensor_name);

// A crossing edge whose bytes are known before the graph runs.
struct StaticTransfer {
  const tensorflow::Edge* edge;
  int dims;
  uint64_t bytes;
};

// Before partitioning: groups `transfers` and records the groups on their ends.
void PlanFusion(tensorflow::Graph& graph, const std::vector<StaticTransfer>& transfers);

// After partitioning: renames the _Send and _Recv nodes of fused transfers in `partition`.
void NameFusedTransfers(tensorflow::Graph& partition);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_PLANNING_FUSION_H_
