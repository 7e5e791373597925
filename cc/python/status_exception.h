// How a failed absl::Status leaves C++ for Python in every tf_rdma module: as the tf_rdma.errors
// class for its kind (cc/transport/error_kinds.h), or for its code where no kind was marked (see
// tf_rdma/errors.py: from_status).
#ifndef TF_RDMA_CC_PYTHON_STATUS_EXCEPTION_H_
#define TF_RDMA_CC_PYTHON_STATUS_EXCEPTION_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cc/transport/error_kinds.h"

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

// Text that may hold bytes a peer chose, as a Python str: invalid UTF-8 is escaped (\xNN) rather
// than raising UnicodeDecodeError in place of the real result or error.
inline pybind11::str ToPython(std::string_view text) {
  PyObject* decoded = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()),
                                           "backslashreplace");
  if (decoded == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::str>(decoded);
}

inline void RegisterStatusTranslator() {
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      pybind11::object errors = pybind11::module_::import("tf_rdma.errors");
      const std::optional<std::string> kind = ErrorKindOf(e.status);
      pybind11::object error = errors.attr("from_status")(
          static_cast<int>(e.status.code()), ToPython(e.status.message()), e.needed,
          kind.has_value() ? pybind11::object(pybind11::str(*kind)) : pybind11::object(pybind11::none()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_PYTHON_STATUS_EXCEPTION_H_
