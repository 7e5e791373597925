// tf_rdma's objects belong to the process that created them. A child forked from it inherits
// copies whose threads did not come along and whose sockets, shared memory and RDMA resources it
// shares with the parent: tearing one down in the child (a socket shutdown, a close frame, a
// deregistration through the shared RDMA context) breaks the parent's, and joining its threads
// crashes the child. So a forked child that lets go of such an object leaks it instead, and using
// one there is an error rather than a wait on threads (or locks) that stayed in the parent.
#ifndef TF_RDMA_CC_TRANSPORT_FORK_GUARD_H_
#define TF_RDMA_CC_TRANSPORT_FORK_GUARD_H_

#include <unistd.h>

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {

// This process's id. getpid() is a syscall (about 190 ns on the development machine) and the
// Python bindings ask on every call, so the id is kept, and a fork handler renews it in the child.
// Defined in fork_guard.cc, so the process has one such id and one fork handler, in the transport
// library, whichever extension asks.
pid_t CurrentPid();

class OwningProcess {
 public:
  // True in a child forked after this object was created.
  bool Inherited() const { return CurrentPid() != pid_; }
  // OK in the owning process; in a forked child, an error saying so about `what`.
  absl::Status CheckNotInherited(std::string_view what) const {
    if (!Inherited()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        what, " belongs to process ", pid_, ", which forked this one (", CurrentPid(),
        "): a forked child cannot use its parent's tf_rdma objects; create a transport of its own "
        "in the child"));
  }

 private:
  pid_t pid_ = CurrentPid();
};

// Keeps `object` (and what it owns) alive for the rest of this process: for what a forked child
// inherited.
template <typename T>
void LeakInherited(T&& object) {
  new std::decay_t<T>(std::forward<T>(object));
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_FORK_GUARD_H_
