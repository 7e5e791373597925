"""The transport (cc/transport/, the tf_rdma._transport bindings) and its C++ unit tests built with
clang under a sanitizer, and tests run against that build (`make sanitizers`, docs/testing.md):

  python -m tools.sanitizers build asan|tsan UNIT_TEST_SOURCE...
      the transport library and the bindings into build/<sanitizer>/tf_rdma/ (through setup.py, as
      pip builds them, into a folder of their own: the package's build in tf_rdma/ is untouched), and
      the unit tests of UNIT_TEST_SOURCE... as build/<sanitizer>/transport_unit_tests, linking that
      library
  python -m tools.sanitizers unit-tests asan|tsan [GTEST_OPTION...]
  python -m tools.sanitizers pytest asan|tsan [PYTEST_ARGUMENT...]
      pytest in this (uninstrumented) Python with the sanitizer's runtime preloaded and the sanitized
      bindings imported as tf_rdma._transport, by this process and every process it starts

asan is AddressSanitizer with UndefinedBehaviorSanitizer, tsan ThreadSanitizer; either stops the
process at its first report. Leaks are looked for in the unit tests only: under Python, the
interpreter's own allocations it never frees would drown ours."""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.setup_py import build_extensions, load_setup_py

ROOT = Path(__file__).resolve().parents[2]
# Line tables only: reports name file and line at a fraction of full debug info's compile time.
COMMON_FLAGS = ["-O1", "-gline-tables-only", "-fno-omit-frame-pointer"]
# The shared runtime the bindings link and Python preloads: clang's, but GCC's for ThreadSanitizer
# (libtsan.so.2, the same runtime from the same sources): clang 14's libclang_rt.tsan-x86_64.so
# crashes at start-up in any process it is preloaded into on Debian 12, /bin/true included.
SANITIZERS = {
    "asan": {"flags": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
             "runtime": ("clang++", "libclang_rt.asan-x86_64.so"),
             "options": {"ASAN_OPTIONS": "halt_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1",
                         "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}},
    "tsan": {"flags": ["-fsanitize=thread"], "runtime": ("g++", "libtsan.so.2"),
             "options": {"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1"}},
}
COMPILER = "clang++"


def build_dir(sanitizer):
    return ROOT / "build" / sanitizer


def runtime_library(sanitizer):
    """The sanitizer's shared runtime, which the bindings link and Python preloads."""
    owner, name = SANITIZERS[sanitizer]["runtime"]
    path = subprocess.run([owner, f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not os.path.isabs(path):
        sys.exit(f"{owner} has no {name} ({sanitizer}'s runtime): install it "
                 "(`apt-get install clang libclang-rt-dev g++` on Debian 12, tools/install_test_prereqs.sh)")
    return Path(path)


def compiler():
    """clang++, through ccache where it is installed (tools/install_test_prereqs.sh installs both)."""
    if not shutil.which(COMPILER):
        sys.exit(f"the sanitizer builds need {COMPILER}: `apt-get install clang` (tools/install_test_prereqs.sh)")
    return ["ccache", COMPILER] if shutil.which("ccache") else [COMPILER]


def linker_flags():
    """LLVM's lld where installed: it links against libtensorflow_framework in a second where GNU ld
    takes several (tools/install_test_prereqs.sh installs it)."""
    return ["-fuse-ld=lld"] if shutil.which("ld.lld") else []


def shared_runtime_link_flags(sanitizer):
    """For the bindings, the runtime preloaded into Python."""
    runtime = runtime_library(sanitizer)
    return [*SANITIZERS[sanitizer]["flags"], *linker_flags(), str(runtime), f"-Wl,-rpath,{runtime.parent}"]


def program_runtime_link_flags(sanitizer):
    """For the unit tests, the same shared runtime as the library they link (two runtimes in one
    process refuse to start): clang's static one left out, by -shared-libasan for AddressSanitizer,
    and for ThreadSanitizer by linking without -fsanitize=thread (clang's runtime) but with GCC's."""
    runtime = runtime_library(sanitizer)
    if sanitizer == "asan":
        return [*SANITIZERS[sanitizer]["flags"], "-shared-libasan", *linker_flags(), f"-Wl,-rpath,{runtime.parent}"]
    return [*linker_flags(), str(runtime), f"-Wl,-rpath,{runtime.parent}"]


def build_bindings(setup_py, sanitizer):
    os.environ["CXX"] = shlex.join(compiler())
    os.environ["CXXFLAGS"] = shlex.join([*SANITIZERS[sanitizer]["flags"], *COMMON_FLAGS])
    os.environ["LDFLAGS"] = shlex.join(shared_runtime_link_flags(sanitizer))
    transport_only = [ext for ext in setup_py.extensions() if not ext.name.endswith("_tensorflow")]
    build_extensions(setup_py, transport_only, build_dir(sanitizer))
    shutil.copy(Path(__file__).with_name("sitecustomize.py"), build_dir(sanitizer) / "sitecustomize.py")


def build_unit_tests(setup_py, sanitizer, sources):
    tensorflow = setup_py.installed_tensorflow()
    flags = [*SANITIZERS[sanitizer]["flags"], *COMMON_FLAGS, "-DNDEBUG", "-Wall", f"-I{ROOT}", *tensorflow["cflags"]]
    objects = [build_dir(sanitizer) / "obj" / Path(source).with_suffix(".o") for source in sources]
    stale = [(source, obj) for source, obj in zip(sources, objects) if setup_py._stale(ROOT / source, obj)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for error in pool.map(lambda so: setup_py._compile(compiler(), flags, *so), stale):
            if error:
                sys.exit(error)
    output = build_dir(sanitizer) / "transport_unit_tests"
    library = build_dir(sanitizer) / "tf_rdma"
    # libcrypto ahead of libtensorflow_framework (which the tests link for absl): a sanitized build
    # loads libcrypto without RTLD_DEEPBIND (cc/transport/crypto.cc), and libcrypto then calls its own
    # functions through the first library of the program that defines them; TensorFlow's BoringSSL
    # defines many under the same names, and OpenSSL's HMAC crashed in them.
    openssl_first = ["-Wl,--no-as-needed", "-l:libcrypto.so.3", "-Wl,--as-needed"]
    subprocess.run([*compiler(), *program_runtime_link_flags(sanitizer), "-o", str(output), *map(str, objects),
                    f"-L{library}", f"-l:lib{setup_py.TRANSPORT_LIBRARY}.so", f"-Wl,-rpath,{library}", "-lgtest",
                    "-lgtest_main", "-pthread", "-ldl", *openssl_first, *tensorflow["lflags"],
                    f"-Wl,-rpath,{tensorflow['lib']}"], check=True)


def sanitized_environment(sanitizer, preload):
    env = dict(os.environ)
    for name, value in SANITIZERS[sanitizer]["options"].items():
        if sanitizer == "asan" and name == "ASAN_OPTIONS":
            value += f":detect_leaks={0 if preload else 1}"
        env[name] = ":".join(filter(None, [value, os.environ.get(name)]))  # the caller's own come last, and win
    if preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [str(runtime_library(sanitizer)), os.environ.get("LD_PRELOAD")]))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(build_dir(sanitizer)), os.environ.get("PYTHONPATH")]))
    return env


def main():
    parser = argparse.ArgumentParser(prog="python -m tools.sanitizers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build", "unit-tests", "pytest"])
    parser.add_argument("sanitizer", choices=sorted(SANITIZERS))
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.action == "build":
        setup_py = load_setup_py()
        build_bindings(setup_py, args.sanitizer)
        build_unit_tests(setup_py, args.sanitizer, args.arguments)
        return 0
    if args.action == "unit-tests":
        command = [str(build_dir(args.sanitizer) / "transport_unit_tests"), *args.arguments]
        return subprocess.run(command, env=sanitized_environment(args.sanitizer, preload=False)).returncode
    env = sanitized_environment(args.sanitizer, preload=True)
    # The tests would pass as well against the ordinary build: make sure they get the sanitized one.
    loaded = subprocess.run([sys.executable, "-c", "import tf_rdma._transport as t; print(t.__file__)"],
                            env=env, cwd=ROOT, capture_output=True, text=True)
    if loaded.returncode != 0 or not loaded.stdout.strip().startswith(str(build_dir(args.sanitizer))):
        sys.exit(f"tools.sanitizers: the tests would not load the {args.sanitizer} build of tf_rdma._transport "
                 f"(they load {loaded.stdout.strip() or loaded.stderr.strip()[-500:]})")
    return subprocess.run([sys.executable, "-m", "pytest", *args.arguments], env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
