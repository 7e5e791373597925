"""Builds tf_rdma against the TensorFlow installed in the target environment.

The C++ is compiled into build/obj/, keyed by the compiler flags, as a few units per extension, each
a generated file that includes a group of its sources (UNITS_PER_EXTENSION); a unit is recompiled only
when one of its sources or a header they include changed, also under pip's isolated builds.
"""
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from hashlib import sha256
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# The version is written once, in the package (tf_rdma.__version__); the build passes it to the C++.
VERSION = re.search(r'^__version__ = "([^"]+)"', (Path(__file__).resolve().parent / "tf_rdma" / "__init__.py")
                    .read_text(), re.M).group(1)
MIN_TENSORFLOW = (2, 16)
ROOT = Path(__file__).resolve().parent



# The TensorFlow side's files spend most of their compile time on the inline code of TensorFlow's,
# protobuf's and absl's headers, which a unit compiles once for all its files: a cold build of every
# extension took 273 s of CPU one file at a time, about 95 s in units (what every user's `pip install`
# and every release of CI's TensorFlow matrix pays). Two units per extension keep two cores busy; a
# one-file change recompiles its unit, half its extension.
UNITS_PER_EXTENSION = 2


def _sources(*patterns):
    return sorted(str(p.relative_to(ROOT)) for pattern in patterns for p in ROOT.glob(pattern))


TRANSPORT_CORE = _sources("cc/transport/*.cc", "cc/transport/stream/*.cc", "cc/transport/tcp/*.cc",
                          "cc/transport/shm/*.cc")
# The transport core is one shared library in the package that both extensions link (found next to
# them through an $ORIGIN rpath), so a process holds one copy of it: its process-wide state (the
# fork guard, the verbs unmap monitor and registration cache, the backends' counters) is shared by
# the Python bindings and the TensorFlow side.
TRANSPORT_LIBRARY = "tf_rdma_transport"
TRANSPORT_LIBRARY_MODULE = f"tf_rdma.lib{TRANSPORT_LIBRARY}"
# The transport layer for Python (tests, CLI, bench); no TensorFlow headers, so it builds fast.
TRANSPORT_MODULE = _sources("cc/bench/*.cc") + ["cc/python/transport_module.cc"]
# The TensorFlow side: the server protocol, its rendezvous and collective transports, the runtime.
# It subclasses TensorFlow's distributed runtime, which lives in libtensorflow_cc and whose headers
# include gRPC's and protobuf's.
TENSORFLOW_MODULE = [s for s in _sources("cc/tf/*/*.cc") if not s.startswith("cc/tf/data/")] + [
    "cc/python/tensorflow_module.cc"]
# The tf.data service protocol (cc/tf/data/) declares TensorFlow internals whose headers the wheel
# does not ship (data_transfer_api.h), as the releases listed here build them; it is compiled only
# against those, and elsewhere tf_rdma.DATA_TRANSFER_PROTOCOL says which releases have it.
DATA_SERVICE_TENSORFLOW = {(2, 21)}
DATA_SERVICE_SOURCES = _sources("cc/tf/data/*.cc")
TENSORFLOW_INCLUDES = ["com_github_grpc_grpc/include", "com_google_protobuf/src", "farmhash_archive/src"]


def verbs_headers_present(compiler):
    """Whether rdma-core's development headers are there: the verbs backend is built only then."""
    probe = "#include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\nint main() { return 0; }\n"
    result = subprocess.run([*compiler, "-x", "c++", "-fsyntax-only", "-"], input=probe, text=True,
                            capture_output=True)
    return result.returncode == 0


VERBS_SOURCES = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("cc/transport/verbs/*.cc"))
# Printed, not raised: a build without verbs still serves tcp and shm, and TF_RDMA_BACKEND=verbs
# then says how to rebuild. pip shows a successful build's output only with -v.
NO_VERBS_WARNING = "\n".join("tf_rdma: " + line for line in [
    "*" * 78,
    "WARNING: building WITHOUT the verbs (RDMA) backend: rdma-core's development headers",
    "(infiniband/verbs.h, rdma/rdma_cma.h) are not on this host. tcp and shm will work; verbs will",
    "not, on any host this build is installed on.",
    "For verbs, install them and rebuild tf_rdma:",
    "  apt-get install libibverbs-dev librdmacm-dev     (Debian, Ubuntu)",
    "  dnf install rdma-core-devel                      (RHEL, Fedora)",
    "*" * 78,
])


class BuildError(SystemExit):
    pass


@functools.lru_cache(maxsize=None)
def installed_tensorflow():
    """Asks the target interpreter, outside pip's build isolation, which TensorFlow it has."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    probe = (
        "import json, tensorflow as tf; print(json.dumps({'version': tf.__version__, "
        "'cflags': tf.sysconfig.get_compile_flags(), 'lflags': tf.sysconfig.get_link_flags(), "
        "'lib': tf.sysconfig.get_lib()}))"
    )
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(
            "tf_rdma builds against the TensorFlow installed in this environment, and "
            f"{sys.executable} cannot import tensorflow:\n{result.stderr.strip().splitlines()[-1:]}\n"
            "Install TensorFlow first (e.g. `pip install tensorflow-cpu`), then install tf_rdma.")
    info = json.loads(result.stdout.strip().splitlines()[-1])
    if tensorflow_release(info["version"]) < MIN_TENSORFLOW:
        raise BuildError(
            f"tf_rdma needs TensorFlow >= {'.'.join(map(str, MIN_TENSORFLOW))}, found "
            f"{info['version']}. Upgrade TensorFlow, then install tf_rdma.")
    return info


def tensorflow_release(version):
    """(major, minor) of a TensorFlow version string."""
    return tuple(int(x) for x in version.split(".")[:2])


def pybind11_include():
    import pybind11
    return pybind11.get_include()


def extensions():
    """What the build makes: the transport library first, as the extensions link it."""
    return [Extension(TRANSPORT_LIBRARY_MODULE, TRANSPORT_CORE),
            Extension("tf_rdma._transport", TRANSPORT_MODULE, libraries=[TRANSPORT_LIBRARY]),
            Extension("tf_rdma._tensorflow", TENSORFLOW_MODULE, libraries=[TRANSPORT_LIBRARY])]


class IncrementalBuildExt(build_ext):
    def get_ext_filename(self, fullname):
        # The transport library is named as the linker looks for it, not as a Python module.
        if fullname in (TRANSPORT_LIBRARY_MODULE, TRANSPORT_LIBRARY_MODULE.rpartition(".")[2]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extensions(self):
        self.check_extensions_list(self.extensions)
        # One at a time even with --parallel: the extensions link the library, so it comes first.
        for ext in sorted(self.extensions, key=lambda ext: ext.name != TRANSPORT_LIBRARY_MODULE):
            self.build_extension(ext)

    def build_extension(self, ext):
        tf = installed_tensorflow()
        include = next(f[2:] for f in tf["cflags"] if f.startswith("-I"))
        is_library = ext.name == TRANSPORT_LIBRARY_MODULE
        links_library = TRANSPORT_LIBRARY in ext.libraries
        # The library exports the transport core; an extension exports its module's init function only.
        visibility = [] if is_library else ["-fvisibility=hidden"]
        cflags = tf["cflags"] + [f"-I{include}/external/{folder}" for folder in TENSORFLOW_INCLUDES] + [
            "-DNDEBUG",  # required: without it TensorFlow's Graph/Node layouts differ from the wheel's
            "-O2", "-fPIC", *visibility, "-Wall", "-Wno-sign-compare",
            f"-DTF_RDMA_VERSION=\"{VERSION}\"", f"-DTF_RDMA_BUILT_WITH_TENSORFLOW=\"{tf['version']}\"",
            f"-I{ROOT}", f"-I{pybind11_include()}", f"-I{sysconfig.get_paths()['include']}",
        ] + shlex.split(os.environ.get("CXXFLAGS", ""))  # e.g. -fsanitize=address for a checked build
        compiler = shlex.split(os.environ.get("CXX", "g++"))  # may start with a launcher (ccache)
        # Not -lcrypto, -libverbs, -lrdmacm: cc/transport/crypto.cc and verbs/rdma_libraries.cc
        # dlopen() them (so no OpenSSL or rdma-core headers are needed to build, and TensorFlow's
        # BoringSSL symbols cannot stand in for OpenSSL's). -ldl for glibc older than 2.34, where
        # dlopen is not in libc itself.
        sources, libraries = list(ext.sources), ["-ldl"]
        if ext.name.endswith("_tensorflow"):
            releases = ", ".join(".".join(map(str, r)) for r in sorted(DATA_SERVICE_TENSORFLOW))
            cflags.append(f"-DTF_RDMA_DATA_SERVICE_TENSORFLOW=\"{releases}\"")
            if tensorflow_release(tf["version"]) in DATA_SERVICE_TENSORFLOW:
                sources += DATA_SERVICE_SOURCES
                cflags.append("-DTF_RDMA_HAVE_DATA_SERVICE")
        # verbs is a backend of the transport core, built into the library; the extensions that link
        # it are told so too (the Python bindings expose verbs' own functions then).
        with_verbs = (is_library or links_library) and verbs_headers_present(compiler)
        if with_verbs:
            cflags.append("-DTF_RDMA_HAVE_VERBS")
        if is_library and with_verbs:
            sources += VERBS_SOURCES
        elif is_library:
            print(NO_VERBS_WARNING, file=sys.stderr, flush=True)
        key = sha256(json.dumps([" ".join(compiler), cflags]).encode()).hexdigest()[:12]
        obj_dir = ROOT / "build" / "obj" / key
        units = _units(ext.name, sources, obj_dir)
        objects = [obj for _, obj in units]
        stale = [(unit, obj) for unit, obj in units if _stale(ROOT / unit, obj)]
        if stale:
            print(f"tf_rdma: compiling {len(stale)} of {len(objects)} units", flush=True)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for error in pool.map(lambda so: _compile(compiler, cflags, *so), stale):
                if error:
                    raise BuildError(error)
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        if is_library:
            libraries = [f"-Wl,-soname,{output.name}", *libraries]
        if links_library:
            # The library is in the same package folder, in the build tree as where it is installed.
            library = Path(self.get_ext_fullpath(TRANSPORT_LIBRARY_MODULE))
            libraries = [f"-L{library.parent}", f"-l{TRANSPORT_LIBRARY}", "-Wl,-rpath,$ORIGIN", *libraries]
        if ext.name.endswith("_tensorflow"):
            libraries = [*libraries, "-l:libtensorflow_cc.so.2"]
        # LDFLAGS as CXXFLAGS: a sanitized build links its sanitizer's runtime (tools/sanitizers).
        link = [*compiler, "-shared", "-o", str(output), *map(str, objects), *tf["lflags"],
                f"-Wl,-rpath,{tf['lib']}", "-Wl,--as-needed", *libraries, *shlex.split(os.environ.get("LDFLAGS", ""))]
        subprocess.run(link, check=True)
        missing = undefined_symbols_nothing_exports(output)
        if missing:
            raise BuildError(missing_symbols_message(output.name, tf["version"], missing))
        if ext.name.endswith("_tensorflow"):
            load_error = load_failure(output)
            if load_error:
                raise BuildError(f"tf_rdma built {output.name} against TensorFlow {tf['version']}, and it "
                                 f"does not load there:\n{load_error}\nPlease report this with the "
                                 "TensorFlow version and `g++ --version`.")


def _dynamic_symbols(path, *nm_options):
    listed = subprocess.run(["nm", "-D", *nm_options, str(path)], capture_output=True, text=True, check=True)
    # "  U name@VERSION" / "0000 T name@@VERSION": the name without its symbol version.
    return {line.split()[-1].split("@")[0] for line in listed.stdout.splitlines() if line.strip()}


def _needed_libraries(path):
    """The shared libraries the loader resolves for `path` (its rpath included), by ldd."""
    listed = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True)
    # "libx.so.1 => /path/libx.so.1 (0x...)", and the loader itself as "/lib64/ld-linux-x86-64.so.2 (0x...)".
    paths = [line.split("=>")[-1].split("(")[0].strip() for line in listed.stdout.splitlines()]
    return [path for path in paths if path.startswith("/")]


def undefined_symbols_nothing_exports(extension):
    """Strong undefined symbols of `extension` that none of its libraries nor this interpreter define.
    The loader would refuse them at import; listing them all here names every one at install time
    (e.g. a template instance a TensorFlow built by another compiler exports under another name)."""
    strong_undefined = set()
    listed = subprocess.run(["nm", "-D", "--undefined-only", str(extension)], capture_output=True, text=True,
                            check=True)
    for line in listed.stdout.splitlines():
        kind, name = line.split()[-2:]
        if kind == "U":
            strong_undefined.add(name.split("@")[0])
    provided = set()
    # The interpreter provides the Python C API (from itself, or from the libpython it loads).
    for library in [*_needed_libraries(extension), sys.executable, *_needed_libraries(sys.executable)]:
        provided |= _dynamic_symbols(library, "--defined-only")
    return sorted(strong_undefined - provided)


def missing_symbols_message(extension, tensorflow_version, missing):
    # c++filt comes with binutils, as nm does; without it the names stay mangled.
    demangled = (subprocess.run(["c++filt"], input="\n".join(missing), capture_output=True, text=True).stdout
                 .split("\n") if shutil.which("c++filt") else missing)
    names = "\n".join(f"  {mangled}\n    = {readable}" for mangled, readable in zip(missing, demangled))
    return (f"tf_rdma's {extension} needs {len(missing)} symbol(s) that TensorFlow {tensorflow_version}'s libraries "
            f"do not export (it would fail to import with 'undefined symbol'):\n{names}\n"
            "This TensorFlow is not supported by this tf_rdma: see the README's list of supported "
            "versions, or report the symbols above with the TensorFlow version.")


def load_failure(extension):
    """Imports the built TensorFlow side in the target interpreter (after TensorFlow, as tf_rdma does);
    the error text if it fails, else None."""
    probe = ("import importlib.util, sys, tensorflow\n"
             f"spec = importlib.util.spec_from_file_location('tf_rdma._tensorflow', {str(extension)!r})\n"
             "module = importlib.util.module_from_spec(spec)\n"
             "spec.loader.exec_module(module)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    try:
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                timeout=600)
    except subprocess.TimeoutExpired:
        return "importing it did not finish within 10 minutes"
    return None if result.returncode == 0 else result.stderr.strip()[-2000:]


def _units(name, sources, obj_dir):
    """[(unit, its object)]: `sources` in UNITS_PER_EXTENSION groups of neighbours (a folder's files
    together), each compiled as a generated file under `obj_dir` that includes them. A unit file is
    rewritten only when its group changed, so that an unchanged one does not look newer than its object."""
    size = -(-len(sources) // UNITS_PER_EXTENSION)
    groups = [sources[i:i + size] for i in range(0, len(sources), size)]
    units = []
    for i, group in enumerate(groups):
        unit = obj_dir / "units" / f"{name.rpartition('.')[2]}_{i}.cc"
        text = "// Generated by setup.py (UNITS_PER_EXTENSION).\n" + "".join(f'#include "{s}"\n' for s in group)
        if not unit.exists() or unit.read_text() != text:
            unit.parent.mkdir(parents=True, exist_ok=True)
            unit.write_text(text)
        units.append((str(unit.relative_to(ROOT)), unit.with_suffix(".o")))
    return units


def _stale(source, obj):
    deps = obj.with_suffix(".d")
    if not obj.exists() or not deps.exists():
        return True
    built = obj.stat().st_mtime
    text = deps.read_text().replace("\\\n", " ")
    files = text.split(":", 1)[1].split() if ":" in text else [str(source)]
    return any(not Path(f).exists() or Path(f).stat().st_mtime > built for f in files)


def _compile(compiler, cflags, source, obj):
    obj.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*compiler, *cflags, "-MMD", "-MF", str(obj.with_suffix(".d")), "-c", str(ROOT / source),
           "-o", str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return f"compiling {source} failed:\n{result.stderr}"
    return None


# Run by pip (setuptools' build backend runs this file as __main__) or by hand; tests import it
# for its checks without building.
if __name__ == "__main__":
    setup(
        name="tf_rdma",
        version=VERSION,
        description="Moves TensorFlow's cross-task tensors with one-sided RDMA writes instead of gRPC",
        packages=find_packages(include=["tf_rdma", "tf_rdma.*"]),
        python_requires=">=3.9",
        ext_modules=extensions(),
        cmdclass={"build_ext": IncrementalBuildExt},
        zip_safe=False,
    )
