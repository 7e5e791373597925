"""The part of rules_cc that Bazel 4.2's own tools load (@bazel_tools//tools/cpp and the C++
toolchain it configures), as Bazel's built-in rules, for building offline with Debian's
bazel-bootstrap: Bazel fetches rules_cc from GitHub otherwise, and Debian's bazel-rules-cc (0.0.4)
needs a newer Bazel (it loads use_cpp_toolchain, which 4.2's @bazel_tools does not have)."""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
