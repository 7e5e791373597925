// Receive buffers planned from static shapes (the MSRA design: the sender writes into a
// destination sized in advance, so even a transfer's first crossing needs no regrant).
//
// A receiving rendezvous sees a key, not the _Recv node, and the partition that holds a _Recv
// says nothing about the shape it will receive. So a pass on the whole placed graph, before
// partitioning (POST_REWRITE_FOR_EXEC: the TF1 master, the process that instantiates a TF2
// multi-device function), infers shapes and records, on each node that consumes a tensor from
// another task, the byte size of that input. The partitioner copies nodes with their attributes
// into the receiving partition; a second pass there (POST_PARTITIONING, in the process that owns
// the partition in TF1) reads the size off the _Recv's consumer and files it under the transfer's
// rendezvous name, where the receiving rendezvous looks it up for its first grant.
#ifndef TF_RDMA_CC_TF_PLANNING_STATIC_SIZES_H_
#define TF_RDMA_CC_TF_PLANNING_STATIC_SIZES_H_

#include <cstdint>
#include <optional>
#include <string>

namespace tf_rdma {

// The planned byte size of `transfer` (a rendezvous key without its frame and iteration), if the
// passes planned it in this process.
std::optional<uint64_t> PlannedBytes(const std::string& transfer);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_PLANNING_STATIC_SIZES_H_
