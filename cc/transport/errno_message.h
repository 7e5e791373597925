// "what: strerror(errno)", the wording of every system call failure the transports report.
#ifndef TF_RDMA_CC_TRANSPORT_ERRNO_MESSAGE_H_
#define TF_RDMA_CC_TRANSPORT_ERRNO_MESSAGE_H_

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace tf_rdma {

inline std::string ErrnoMessage(const char* what, int error) {
  return absl::StrCat(what, ": ", std::strerror(error));
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_ERRNO_MESSAGE_H_
