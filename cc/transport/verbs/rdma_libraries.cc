#include "cc/transport/verbs/rdma_libraries.h"

#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

// Every function of libibverbs (IBVERBS) and librdmacm (RDMACM) the verbs backend calls, directly
// or through verbs.h's inline functions (ibv_reg_mr calls ibv_reg_mr_iova2, ibv_query_gid_ex
// _ibv_query_gid_ex, ...): what `nm -u` lists for its objects. One missing here leaves an
// undefined symbol in the extension, which tests/transport/verbs/test_rdma_libraries.py catches.
// X(library, return type, name, parameters, arguments)
#define TF_RDMA_RDMA_FUNCTIONS(X)                                                                  \
  X(IBVERBS, void, ibv_ack_cq_events, (ibv_cq * cq, unsigned int nevents), (cq, nevents))          \
  X(IBVERBS, ibv_pd*, ibv_alloc_pd, (ibv_context * context), (context))                            \
  X(IBVERBS, int, ibv_close_device, (ibv_context * context), (context))                            \
  X(IBVERBS, ibv_comp_channel*, ibv_create_comp_channel, (ibv_context * context), (context))       \
  X(IBVERBS, ibv_cq*, ibv_create_cq,                                                               \
    (ibv_context * context, int cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector), \
    (context, cqe, cq_context, channel, comp_vector))                                              \
  X(IBVERBS, ibv_qp*, ibv_create_qp, (ibv_pd * pd, ibv_qp_init_attr * attr), (pd, attr))          \
  X(IBVERBS, int, ibv_dealloc_pd, (ibv_pd * pd), (pd))                                             \
  X(IBVERBS, int, ibv_dereg_mr, (ibv_mr * mr), (mr))                                               \
  X(IBVERBS, int, ibv_destroy_comp_channel, (ibv_comp_channel * channel), (channel))               \
  X(IBVERBS, int, ibv_destroy_cq, (ibv_cq * cq), (cq))                                             \
  X(IBVERBS, int, ibv_destroy_qp, (ibv_qp * qp), (qp))                                             \
  X(IBVERBS, int, ibv_fork_init, (void), ())                                                       \
  X(IBVERBS, void, ibv_free_device_list, (ibv_device * *list), (list))                             \
  X(IBVERBS, int, ibv_get_cq_event, (ibv_comp_channel * channel, ibv_cq * *cq, void** cq_context), \
    (channel, cq, cq_context))                                                                     \
  X(IBVERBS, ibv_device**, ibv_get_device_list, (int* num_devices), (num_devices))                 \
  X(IBVERBS, const char*, ibv_get_device_name, (ibv_device * device), (device))                    \
  X(IBVERBS, ibv_fork_status, ibv_is_fork_initialized, (void), ())                                 \
  X(IBVERBS, int, ibv_modify_qp, (ibv_qp * qp, ibv_qp_attr * attr, int attr_mask),                 \
    (qp, attr, attr_mask))                                                                         \
  X(IBVERBS, ibv_context*, ibv_open_device, (ibv_device * device), (device))                       \
  X(IBVERBS, int, ibv_query_device, (ibv_context * context, ibv_device_attr * attr),               \
    (context, attr))                                                                               \
  X(IBVERBS, int, ibv_query_qp,                                                                    \
    (ibv_qp * qp, ibv_qp_attr * attr, int attr_mask, ibv_qp_init_attr* init),                      \
    (qp, attr, attr_mask, init))                                                                   \
  X(IBVERBS, int, ibv_query_port,                                                                  \
    (ibv_context * context, uint8_t port_num, _compat_ibv_port_attr * attr),                       \
    (context, port_num, attr))                                                                     \
  X(IBVERBS, ibv_mr*, ibv_reg_mr_iova2,                                                            \
    (ibv_pd * pd, void* addr, size_t length, uint64_t iova, unsigned int access),                  \
    (pd, addr, length, iova, access))                                                              \
  X(IBVERBS, const char*, ibv_wc_status_str, (ibv_wc_status status), (status))                     \
  X(IBVERBS, int, _ibv_query_gid_ex,                                                               \
    (ibv_context * context, uint32_t port_num, uint32_t gid_index, ibv_gid_entry* entry,           \
     uint32_t flags, size_t entry_size),                                                           \
    (context, port_num, gid_index, entry, flags, entry_size))                                      \
  X(RDMACM, int, rdma_accept, (rdma_cm_id * id, rdma_conn_param* param), (id, param))              \
  X(RDMACM, int, rdma_ack_cm_event, (rdma_cm_event * event), (event))                              \
  X(RDMACM, int, rdma_bind_addr, (rdma_cm_id * id, sockaddr* addr), (id, addr))                    \
  X(RDMACM, int, rdma_connect, (rdma_cm_id * id, rdma_conn_param* param), (id, param))             \
  X(RDMACM, rdma_event_channel*, rdma_create_event_channel, (void), ())                            \
  X(RDMACM, int, rdma_create_id,                                                                   \
    (rdma_event_channel * channel, rdma_cm_id** id, void* context, rdma_port_space ps),            \
    (channel, id, context, ps))                                                                    \
  X(RDMACM, void, rdma_destroy_event_channel, (rdma_event_channel * channel), (channel))           \
  X(RDMACM, int, rdma_destroy_id, (rdma_cm_id * id), (id))                                         \
  X(RDMACM, int, rdma_disconnect, (rdma_cm_id * id), (id))                                         \
  X(RDMACM, int, rdma_establish, (rdma_cm_id * id), (id))                                          \
  X(RDMACM, const char*, rdma_event_str, (rdma_cm_event_type event), (event))                      \
  X(RDMACM, void, rdma_free_devices, (ibv_context * *list), (list))                                \
  X(RDMACM, int, rdma_get_cm_event, (rdma_event_channel * channel, rdma_cm_event** event),         \
    (channel, event))                                                                              \
  X(RDMACM, ibv_context**, rdma_get_devices, (int* num_devices), (num_devices))                    \
  X(RDMACM, __be16, rdma_get_src_port, (rdma_cm_id * id), (id))                                    \
  X(RDMACM, int, rdma_init_qp_attr, (rdma_cm_id * id, ibv_qp_attr* attr, int* attr_mask),          \
    (id, attr, attr_mask))                                                                         \
  X(RDMACM, int, rdma_listen, (rdma_cm_id * id, int backlog), (id, backlog))                       \
  X(RDMACM, int, rdma_migrate_id, (rdma_cm_id * id, rdma_event_channel* channel), (id, channel))   \
  X(RDMACM, int, rdma_reject, (rdma_cm_id * id, const void* data, uint8_t length),                 \
    (id, data, length))                                                                            \
  X(RDMACM, int, rdma_resolve_addr,                                                                \
    (rdma_cm_id * id, sockaddr* source, sockaddr* destination, int timeout_ms),                    \
    (id, source, destination, timeout_ms))                                                         \
  X(RDMACM, int, rdma_resolve_route, (rdma_cm_id * id, int timeout_ms), (id, timeout_ms))          \
  X(RDMACM, int, rdma_set_option,                                                                  \
    (rdma_cm_id * id, int level, int optname, void* optval, size_t optlen),                        \
    (id, level, optname, optval, optlen))

namespace tf_rdma {
namespace verbs {
namespace {

constexpr char kInstall[] =
    "Install rdma-core's runtime libraries: `apt-get install libibverbs1 librdmacm1 "
    "ibverbs-providers` (Debian, Ubuntu) or `dnf install rdma-core` (RHEL, Fedora)";

// What the `library` column of TF_RDMA_RDMA_FUNCTIONS names.
enum Library { IBVERBS, RDMACM, kLibraryCount };
constexpr const char* kLibraryFile[kLibraryCount] = {"libibverbs.so.1", "librdmacm.so.1"};

// The resolved functions: written once by LoadRdmaLibraries (under std::call_once, so every
// thread that saw it return OK, and every thread started after, sees them), read by the forwarders.
struct RdmaFunctions {
#define TF_RDMA_POINTER(library, ret, name, params, args) ret(*name) params = nullptr;
  TF_RDMA_RDMA_FUNCTIONS(TF_RDMA_POINTER)
#undef TF_RDMA_POINTER
};
RdmaFunctions resolved;

std::string DlError() {
  const char* error = dlerror();
  return error != nullptr ? error : "no reason given";
}

absl::Status Load() {
  void* handles[kLibraryCount] = {};
  std::vector<std::string> missing;
  for (int library = 0; library < kLibraryCount; ++library) {
    // RTLD_LOCAL: rdma-core's symbols stay out of the process's global scope, where they could
    // clash with another copy some other library loaded.
    handles[library] = dlopen(kLibraryFile[library], RTLD_NOW | RTLD_LOCAL);
    if (handles[library] == nullptr) missing.push_back(absl::StrCat(kLibraryFile[library], " (", DlError(), ")"));
  }
  auto close_all = [&] {
    for (void* handle : handles) {
      if (handle != nullptr) dlclose(handle);
    }
  };
  if (!missing.empty()) {
    close_all();
    return absl::UnimplementedError(absl::StrCat(
        "the verbs backend needs rdma-core's runtime libraries, and this host cannot load ",
        absl::StrJoin(missing, " nor "), ". ", kInstall));
  }
  RdmaFunctions found;
  std::vector<std::string> absent;
#define TF_RDMA_RESOLVE(library, ret, name, params, args)                           \
  found.name = reinterpret_cast<ret(*) params>(dlsym(handles[library], #name));      \
  if (found.name == nullptr) absent.push_back(absl::StrCat(kLibraryFile[library], ": " #name));
  TF_RDMA_RDMA_FUNCTIONS(TF_RDMA_RESOLVE)
#undef TF_RDMA_RESOLVE
  if (!absent.empty()) {
    close_all();
    return absl::UnimplementedError(absl::StrCat(
        "rdma-core on this host is older than the one tf_rdma was built against: it lacks ",
        absl::StrJoin(absent, ", "), ". Upgrade rdma-core (`apt-get install libibverbs1 librdmacm1 "
        "ibverbs-providers` or `dnf upgrade rdma-core`)"));
  }
  // The libraries stay loaded for the life of the process: connections, memory registrations and
  // rdma-core's own threads use them until exit.
  resolved = found;
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadRdmaLibraries() {
  static std::once_flag once;
  static absl::Status status;
  std::call_once(once, [] { status = Load(); });
  return status;
}

}  // namespace verbs
}  // namespace tf_rdma

// The forwarders: the names the verbs code (and verbs.h's inline functions) call, defined here with
// hidden visibility so calls bind to them inside the transport library. The parentheses around the name
// keep verbs.h's function-like macros of the same name (ibv_query_port) from expanding.
#define TF_RDMA_FORWARD(library, ret, name, params, args) \
  extern "C" __attribute__((visibility("hidden"))) ret(name) params { return (tf_rdma::verbs::resolved.name)args; }
TF_RDMA_RDMA_FUNCTIONS(TF_RDMA_FORWARD)
#undef TF_RDMA_FORWARD
