"""Writes the @tf_rdma_config repository (tools/bazel/configure.bzl runs it): the TensorFlow,
pybind11 and Python installed in the environment of the interpreter running this, as Bazel
libraries, and what setup.py would build against them, as config.bzl.

Usage: python tools/bazel/configure.py REPOSITORY_DIRECTORY
Everything setup.py decides (the version, the TensorFlow releases with the tf.data service
protocol, the verbs header probe, the include folders, the units per extension) is asked of
setup.py itself, so the two builds cannot drift apart.
"""
import json
import os
import shlex
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import setup  # noqa: E402  (setup.py runs setuptools only as __main__)

GTEST_HEADER = Path("/usr/include/gtest/gtest.h")


def string_define(name, value):
    """A `defines` entry that reaches the compiler as NAME="value": Bazel splits each entry as a
    Bourne shell would, so the quotes it keeps are quoted once more."""
    return shlex.quote(f'{name}="{value}"')


def starlark(value):
    return json.dumps(value)  # a JSON string or list of strings reads the same in Starlark


def main(repository):
    repository = Path(repository)
    tf = setup.installed_tensorflow()
    release = setup.tensorflow_release(tf["version"])
    include = next(f[2:] for f in tf["cflags"] if f.startswith("-I"))
    # The include folder itself goes in through `includes`; the other flags (the C++ ABI and standard,
    # Eigen's alignment) must be given to every file that includes TensorFlow's headers.
    tensorflow_copts = [f for f in tf["cflags"] if not f.startswith("-I")]
    have_data_service = release in setup.DATA_SERVICE_TENSORFLOW
    have_verbs = setup.verbs_headers_present(shlex.split(os.environ.get("CXX", "g++")))
    if not GTEST_HEADER.exists():
        raise SystemExit(f"tf_rdma's C++ unit tests need GoogleTest, and {GTEST_HEADER} is missing: "
                         "`apt-get install libgtest-dev` (tools/install_test_prereqs.sh installs it)")

    for link, target in (("tensorflow_include", include), ("pybind11_include", setup.pybind11_include()),
                         ("python_include", sysconfig.get_paths()["include"])):
        (repository / link).unlink(missing_ok=True)
        (repository / link).symlink_to(target)

    releases = ", ".join(".".join(map(str, r)) for r in sorted(setup.DATA_SERVICE_TENSORFLOW))
    defines = [string_define("TF_RDMA_VERSION", setup.VERSION),
               string_define("TF_RDMA_BUILT_WITH_TENSORFLOW", tf["version"])]
    if have_verbs:
        defines.append("TF_RDMA_HAVE_VERBS")
    (repository / "config.bzl").write_text(
        f'"""What tools/bazel/configure.py found (TensorFlow {tf["version"]} for {sys.executable})."""\n'
        f"UNITS_PER_EXTENSION = {setup.UNITS_PER_EXTENSION}\n"
        f"HAVE_VERBS = {have_verbs!r}\n"
        f"HAVE_DATA_SERVICE = {have_data_service!r}\n"
        f"DATA_SERVICE_DEFINES = {starlark([string_define('TF_RDMA_DATA_SERVICE_TENSORFLOW', releases)])}\n"
        f"TENSORFLOW_COPTS = {starlark(tensorflow_copts)}\n")
    lib = tf["lib"]
    external = [f"tensorflow_include/external/{folder}" for folder in setup.TENSORFLOW_INCLUDES]
    (repository / "BUILD").write_text(f'''# Written by tools/bazel/configure.py; `bazel sync --configure` rewrites it.
package(default_visibility = ["//visibility:public"])

# What setup.py passes to every unit: the version, the TensorFlow built against, verbs or not.
cc_library(
    name = "build_info",
    defines = {starlark(defines)},
)

cc_library(
    name = "tensorflow_headers",
    hdrs = glob(["tensorflow_include/**"]),
    includes = {starlark(["tensorflow_include", *external])},
)

# absl, tsl and the framework: what the transport core and the tests of its pure code link.
cc_library(
    name = "tensorflow_framework",
    linkopts = {starlark([*tf["lflags"], "-Wl,-rpath," + lib])},
    deps = [":tensorflow_headers"],
)

# TensorFlow's distributed runtime (GrpcServer and its managers), for the TensorFlow side.
cc_library(
    name = "tensorflow_cc",
    linkopts = ["-L{lib}", "-l:libtensorflow_cc.so.2"],
    deps = [":tensorflow_framework"],
)

# pybind11 and the Python headers; an extension does not link libpython (the interpreter provides it).
cc_library(
    name = "pybind11",
    hdrs = glob(["pybind11_include/**", "python_include/**"]),
    includes = ["pybind11_include", "python_include"],
)

# GoogleTest from Debian's libgtest-dev, in the compiler's default search paths.
cc_library(
    name = "gtest_main",
    linkopts = ["-lgtest", "-lgtest_main", "-pthread"],
)
''')


if __name__ == "__main__":
    main(sys.argv[1])
