// What a build of tf_rdma was made with, for `python -m tf_rdma info` and for refusing to load the
// TensorFlow side into a TensorFlow other than the one it was built against (its internal class
// layouts differ from release to release).
#ifndef TF_RDMA_CC_PYTHON_BUILD_INFO_H_
#define TF_RDMA_CC_PYTHON_BUILD_INFO_H_

#include <pybind11/pybind11.h>

// setup.py defines it; a Bazel build inside TensorFlow's tree is built with that tree.
#ifndef TF_RDMA_BUILT_WITH_TENSORFLOW
#define TF_RDMA_BUILT_WITH_TENSORFLOW "(the TensorFlow source tree it was built in)"
#endif

namespace tf_rdma {

inline void AddBuildInfo(pybind11::module_& m) {
  m.attr("BUILT_WITH_TENSORFLOW") = TF_RDMA_BUILT_WITH_TENSORFLOW;
#if defined(__clang__)
  m.attr("COMPILER") = "clang " __clang_version__;
#elif defined(__GNUC__)
  m.attr("COMPILER") = "g++ " __VERSION__;
#else
  m.attr("COMPILER") = "unknown";
#endif
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_PYTHON_BUILD_INFO_H_
