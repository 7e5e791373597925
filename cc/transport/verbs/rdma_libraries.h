// rdma-core's runtime libraries, loaded when verbs is first asked for rather than linked, so one
// build of tf_rdma imports, and runs tcp and shm, on hosts without them (most hosts of a cluster
// that is not all RDMA), while verbs works wherever they are installed.
//
// rdma_libraries.cc defines every libibverbs/librdmacm function the verbs backend calls, under the
// same names with hidden visibility, forwarding to the functions resolved here; the verbs code
// calls them as usual and the transport library keeps no undefined ibv_/rdma_ symbol for the dynamic
// linker to fail on. A forwarder may run only after LoadRdmaLibraries() returned OK: VerbsAvailable
// and VerbsReaches, the gates of every entry into the verbs backend (backend_registry.h), check it.
#ifndef TF_RDMA_CC_TRANSPORT_VERBS_RDMA_LIBRARIES_H_
#define TF_RDMA_CC_TRANSPORT_VERBS_RDMA_LIBRARIES_H_

#include "absl/status/status.h"

namespace tf_rdma {
namespace verbs {

// Loads libibverbs.so.1 and librdmacm.so.1 and resolves every function the verbs backend uses,
// once per process (later calls return the first answer). Otherwise Unimplemented, as the other
// reasons verbs cannot work here (no device) are, so Python raises BackendUnavailableError: the
// message names what is missing (a library, or a function an older rdma-core lacks) and the
// command that installs it.
absl::Status LoadRdmaLibraries();

}  // namespace verbs
}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_VERBS_RDMA_LIBRARIES_H_
