#!/usr/bin/env python3
"""The TensorFlow releases tf_rdma supports, each in a virtual environment of its own with tf_rdma
built into it, as a user would install it (`pip install --no-build-isolation .` next to the
TensorFlow wheel from the package index).

    tools/tensorflow_versions.py list              the supported wheels, one a line
    tools/tensorflow_versions.py install WHEEL     its venv (made once, then reused) with this tf_rdma
                                                   built into it; prints the venv's python
    tools/tensorflow_versions.py prepare --build-id ID [WHEEL...]
                                                   installs each (default: BUILT_APART) in turn and
                                                   marks its build ID: a later
                                                   `install_tf_rdma(WHEEL, ID)` reuses it

The venvs live in TFRDMA_TEST_VERSIONS_CACHE (default ~/.cache/tf_rdma/tensorflow-versions) and are
reused between runs on the same machine, as far as the disk allows: before a venv is made, the
half-made ones of interrupted runs and then the least recently used others are deleted until
VENV_SPACE is free (seven venvs take 11 GiB, and a machine whose disk filled up half way through
the matrix failed every test after it, not just the matrix); tf_rdma is rebuilt into them each
time, through ccache
when it is installed (tools/dev_env.sh installs it), so an unchanged tree rebuilds in seconds.
tests/tensorflow_versions/ runs the matrix (BUILT_APART: SUPPORTED but the test suite's own
environment); the README's support table lists exactly SUPPORTED. `prepare` runs in the background
from the start of `make test` (tools/run_tests.sh), or of a pytest session that runs the matrix
(tests/tensorflow_versions/conftest.py), so processes may share a venv: each venv is locked while
it is made, filled or built into, and skipped by make_room while locked; tf_rdma is built into one
venv at a time (they share the checkout's build/).
"""
import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The pip requirements the README lists. tensorflow-cpu 2.21.0 is also the test suite's own
# environment (requirements-dev.txt, .venv), where every test runs on it.
SUPPORTED = [
    "tensorflow-cpu==2.16.2",
    "tensorflow-cpu==2.17.1",
    "tensorflow-cpu==2.18.1",
    "tensorflow-cpu==2.19.1",
    "tensorflow-cpu==2.20.0",
    "tensorflow-cpu==2.21.0",
    "tensorflow==2.21.0",
]
SUITE_ENVIRONMENT = "tensorflow-cpu==2.21.0"
# Built apart and run by tests/tensorflow_versions/: all but the suite's own (its `pip install .`
# path is tensorflow==2.21.0's, the same release).
BUILT_APART = [wheel for wheel in SUPPORTED if wheel != SUITE_ENVIRONMENT]
# Free disk a venv's making needs: the largest (tensorflow 2.21.0) takes 2.1 GiB, its unpacking more.
VENV_SPACE = 4 << 30
# What building tf_rdma without build isolation needs besides TensorFlow.
BUILD_REQUIREMENTS = ["pybind11>=2.10", "setuptools>=64", "wheel"]


class VersionsError(RuntimeError):
    pass


def cache_root():
    return Path(os.environ.get("TFRDMA_TEST_VERSIONS_CACHE", "~/.cache/tf_rdma/tensorflow-versions")).expanduser()


def venv_of(wheel):
    return cache_root() / wheel.replace("==", "-")


@contextlib.contextmanager
def _locked(path):
    """Held until the block ends; waits for whoever holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _lock_of(venv):
    return venv.with_name(venv.name + ".lock")


def _in_use(venv):
    try:
        f = open(_lock_of(venv))
    except FileNotFoundError:
        return False  # never locked
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def _run(command, what, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise VersionsError(f"{what} failed ({' '.join(map(str, command))}):\n"
                            f"{(result.stdout + result.stderr)[-4000:]}")
    return result


def ensure_venv(wheel):
    """The venv of `wheel`, made and filled once; a venv whose install was interrupted is made again."""
    if wheel not in SUPPORTED:
        raise VersionsError(f"{wheel} is not one of the supported wheels: {', '.join(SUPPORTED)}")
    venv = venv_of(wheel)
    python = venv / "bin" / "python"
    done = venv / ".tensorflow-installed"
    if done.exists() and done.read_text() == wheel:
        done.touch()  # its time is when it was last used (make_room)
        return python
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    make_room(venv)
    _run([sys.executable, "-m", "venv", str(venv)], f"creating the venv for {wheel}")
    _run([str(python), "-m", "pip", "install", "-q", wheel, *BUILD_REQUIREMENTS], f"pip install {wheel}",
         timeout=1800)
    done.write_text(wheel)
    return python


def make_room(venv):
    """Deletes cached venvs other than `venv` and those in use until VENV_SPACE is free: first those
    an interrupted run left half made (no marker: never reused, as ensure_venv makes them again),
    then the least recently used."""

    def last_used(v):
        marker = v / ".tensorflow-installed"
        return marker.stat().st_mtime if marker.exists() else float("-inf")

    others = sorted((v for v in cache_root().iterdir()
                     if v != venv and (v / "pyvenv.cfg").exists() and not _in_use(v)), key=last_used)
    while shutil.disk_usage(cache_root()).free < VENV_SPACE and others:
        shutil.rmtree(others.pop(0), ignore_errors=True)
    free = shutil.disk_usage(cache_root()).free
    if free < VENV_SPACE:
        raise VersionsError(f"{free >> 20} MiB free under {cache_root()}, and a TensorFlow venv needs "
                            f"{VENV_SPACE >> 30} GiB: free some disk, or point TFRDMA_TEST_VERSIONS_CACHE at a disk "
                            "with room")


def build_environment():
    """The compiler through ccache when there is one: each release's objects are cached by content,
    whatever folder the checkout is in (CCACHE_BASEDIR makes the paths under it relative)."""
    env = dict(os.environ)
    ccache = shutil.which("ccache")
    if ccache and "CXX" not in env:
        env["CXX"] = f"{ccache} g++"
        env.setdefault("CCACHE_BASEDIR", str(ROOT))
        env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
    return env


def install_tf_rdma(wheel, build_id=None):
    """Builds this checkout into the venv of `wheel` as a user's `pip install` would; returns its python.
    With `build_id`, a build marked with the same ID (by `prepare`, from the same checkout) is kept."""
    venv = venv_of(wheel)
    with _locked(_lock_of(venv)):
        python = ensure_venv(wheel)
        built = venv / ".tf_rdma-build"
        if build_id and built.exists() and built.read_text() == build_id:
            return python
        built.unlink(missing_ok=True)
        with _locked(cache_root() / "build.lock"):
            _run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                  "--force-reinstall", str(ROOT)], f"pip install tf_rdma into {wheel}", env=build_environment(),
                 timeout=1800)
        if build_id:
            built.write_text(build_id)
    return python


def prepare(wheels, build_id):
    """Installs each wheel in turn; one that fails is left for its test to install again and report."""
    failed = 0
    for wheel in wheels:
        try:
            install_tf_rdma(wheel, build_id)
            print(f"tensorflow_versions: prepared {wheel}", flush=True)
        except VersionsError as e:
            failed += 1
            print(f"tensorflow_versions: preparing {wheel}: {e}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list")
    install = commands.add_parser("install")
    install.add_argument("wheel", choices=SUPPORTED)
    prepare_parser = commands.add_parser("prepare")
    prepare_parser.add_argument("--build-id", required=True)
    # No `choices`: argparse checks them against the default list of a `*` argument as one value.
    prepare_parser.add_argument("wheels", nargs="*", help="of SUPPORTED; default: those "
                                "tests/tensorflow_versions runs (BUILT_APART)")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(SUPPORTED))
        return 0
    if args.command == "prepare":
        unknown = [wheel for wheel in args.wheels if wheel not in SUPPORTED]
        if unknown:
            parser.error(f"not supported: {', '.join(unknown)} (supported: {', '.join(SUPPORTED)})")
        return prepare(args.wheels or BUILT_APART, args.build_id)
    try:
        print(install_tf_rdma(args.wheel))
    except VersionsError as e:
        print(f"tensorflow_versions: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
