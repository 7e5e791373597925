// How a failed absl::Status leaves C++ for Python in every tf_rdma module: as the tf_rdma.errors
// class for its code (see tf_rdma/errors.py: from_status).
#ifndef TF_RDMA_CC_PYTHON_STATUS_EXCEPTION_H_
#define TF_RDMA_CC_PYTHON_STATUS_EXCEPTION_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tf_rdma {

// Thrown without the GIL (blocking calls release it); translated once the GIL is back.
struct StatusException {
  absl::Status status;
  uint64_t needed = 0;  // for MessageTooLargeError
};

inline void ThrowIfError(const absl::Status& status, uint64_t needed = 0) {
  if (!status.ok()) throw StatusException{status, needed};
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  ThrowIfError(value.status());
  return *std::move(value);
}

inline void RegisterStatusTranslator() {
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      pybind11::object errors = pybind11::module_::import("tf_rdma.errors");
      pybind11::object error = errors.attr("from_status")(
          static_cast<int>(e.status.code()), std::string(e.status.message()), e.needed);
      PyErr_SetObject(error.get_type().ptr(), error.ptr());
    }
  });
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_PYTHON_STATUS_EXCEPTION_H_
