// tf_rdma's objects belong to the process that created them. A child forked from it inherits
// copies whose threads did not come along and whose sockets, shared memory and RDMA resources it
// shares with the parent: tearing one down in the child (a socket shutdown, a close frame, a
// deregistration through the shared RDMA context) breaks the parent's, and joining its threads
// crashes the child. So a forked child that lets go of such an object leaks it instead.
#ifndef TF_RDMA_CC_TRANSPORT_FORK_GUARD_H_
#define TF_RDMA_CC_TRANSPORT_FORK_GUARD_H_

#include <unistd.h>

#include <utility>

namespace tf_rdma {

class OwningProcess {
 public:
  // True in a child forked after this object was created.
  bool Inherited() const { return getpid() != pid_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = getpid();
};

// Keeps `object` (and what it owns) alive for the rest of this process: for what a forked child
// inherited.
template <typename T>
void LeakInherited(T&& object) {
  new std::decay_t<T>(std::forward<T>(object));
}

// A unique_ptr deleter that deletes only in the owning process.
struct DeleteInOwningProcess {
  OwningProcess owner;
  template <typename T>
  void operator()(T* object) const {
    if (!owner.Inherited()) delete object;
  }
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_FORK_GUARD_H_
