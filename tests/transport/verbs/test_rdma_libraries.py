"""rdma-core's runtime libraries are loaded when verbs is first asked for, not linked
(cc/transport/verbs/rdma_libraries.cc): one build imports and runs tcp and shm on a host without
libibverbs and librdmacm, and there says what is missing and the command that installs it.

The host without them is this one with the libraries hidden: a private mount namespace (root only,
as CI runs) with /dev/null bound over each library file the dynamic linker would find."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tf_rdma
from tf_rdma import _transport

PACKAGE = Path(tf_rdma.__file__).parent
TRANSPORT_TESTS = Path(__file__).resolve().parents[1]
LIBRARIES = ("libibverbs.so.1", "librdmacm.so.1")
INSTALL = "`apt-get install libibverbs1 librdmacm1 ibverbs-providers` (Debian, Ubuntu) or `dnf install rdma-core`"
# TEST-NET-2 (RFC 5737): never an address of this host, and no packet is sent to it.
ANOTHER_HOST = "198.51.100.7"
# A build without rdma-core's headers has no verbs code to load libraries for (tests/test_setup.py).
pytestmark = pytest.mark.skipif(not hasattr(_transport._testing, "decode_verbs_message"),
                                reason="this tf_rdma build has no verbs backend")


def built_files():
    """The transport library (where the verbs code is) and the extensions that link it."""
    found = sorted([*PACKAGE.glob("_*.so"), *PACKAGE.glob("libtf_rdma_transport.so")])
    assert {p.name.split(".")[0] for p in found} == {"_transport", "_tensorflow", "libtf_rdma_transport"}, found
    return found


@pytest.mark.parametrize("extension", built_files(), ids=lambda p: p.name.split(".")[0])
def test_the_built_files_neither_link_rdma_core_nor_leave_its_symbols_undefined(extension):
    needed = subprocess.run(["readelf", "-d", str(extension)], capture_output=True, text=True, check=True).stdout
    assert not [line for line in needed.splitlines() if "NEEDED" in line and ("ibverbs" in line or "rdmacm" in line)], needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(extension)], capture_output=True, text=True,
                               check=True).stdout.split()
    # An ibv_/rdma_ function the verbs code calls that rdma_libraries.cc does not forward would be
    # left for the dynamic linker, and the import would fail on hosts without rdma-core.
    assert not [s for s in undefined if s.lstrip("_").startswith(("ibv_", "rdma_"))], undefined


def library_files():
    """The files the dynamic linker loads for LIBRARIES: ld.so.cache's entries, symlinks resolved."""
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    return sorted({os.path.realpath(line.split("=>")[1].strip()) for line in cache.splitlines()
                   if line.strip().split(" ")[0] in LIBRARIES})


def run_without_rdma_core(script):
    """Runs `script` with this Python in a mount namespace where LIBRARIES cannot be loaded. Its
    bound is generous: `python -m tf_rdma info` in it imports TensorFlow in a child, which takes a
    minute or more in the Soft-RoCE guest under emulation (120 s ran out there on a loaded host)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding libraries needs root and unshare (CI runs as root)")
    hide = "".join(f"mount --bind /dev/null {path} && " for path in library_files())
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    environment["PYTHONPATH"] = str(TRANSPORT_TESTS)
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                             f'{hide}exec "$0" -c "$1"', sys.executable, textwrap.dedent(script)],
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.without_rdma_core
def test_without_rdma_core_tcp_and_shm_work_and_verbs_says_what_to_install():
    report = run_without_rdma_core(f"""
        import ctypes, json, os, subprocess, sys
        for library in {LIBRARIES!r}:  # the namespace really hides them
            try:
                ctypes.CDLL(library)
                raise SystemExit(library + " still loads")
            except OSError:
                pass
        import tf_rdma
        from tests.transport.helpers import connected_pair, pattern
        from tf_rdma import _transport, errors

        for backend in ("tcp", "shm"):
            with connected_pair(backend) as (receiver, from_sender, to_receiver):
                payload = pattern(1 << 20, seed=5)
                region = receiver.allocate_region(len(payload))
                grant = from_sender.grant(7, region, 0, len(payload))
                to_receiver.write(7, payload).wait(60)
                assert grant.wait(60) == len(payload) and memoryview(region)[:len(payload)] == payload, backend

        report = {{"verbs": _transport.backend_available("verbs"),
                   "auto_remote": _transport.choose_backend("auto", {ANOTHER_HOST!r}),
                   "auto_local": _transport.choose_backend("auto", "127.0.0.1")}}
        try:
            _transport.Transport("verbs", name="a", cluster_key=b"k")
        except errors.TransportError as e:
            report["create"] = type(e).__name__ + ": " + str(e)
        # As a user meets it: TF_RDMA_BACKEND=verbs, and `python -m tf_rdma info`.
        explicit = subprocess.run(
            [sys.executable, "-c", "from tf_rdma.transport import choose_backend; choose_backend({ANOTHER_HOST!r})"],
            env=dict(os.environ, TF_RDMA_BACKEND="verbs"), capture_output=True, text=True)
        report["explicit"] = [explicit.returncode, explicit.stderr.strip().splitlines()[-1]]
        info = subprocess.run([sys.executable, "-m", "tf_rdma", "info"], capture_output=True, text=True)
        report["info"] = [info.returncode, info.stdout + info.stderr]
        report["mapped"] = [line for line in open("/proc/self/maps") if "ibverbs" in line or "rdmacm" in line]
        print(json.dumps(report))
    """)
    usable, why = report["verbs"]
    assert not usable
    assert why.startswith("the verbs backend needs rdma-core's runtime libraries, and this host cannot "
                          "load libibverbs.so.1 ("), why
    assert "librdmacm.so.1 (" in why and f"Install rdma-core's runtime libraries: {INSTALL}" in why, why
    assert report["auto_remote"] == ["tcp", f"verbs unusable: {why}"], report
    assert report["auto_local"] == ["shm", "peer is on this host"], report
    assert report["create"] == f"BackendUnavailableError: the verbs backend is not available: {why}", report
    code, last_line = report["explicit"]
    assert code != 0 and last_line.startswith("tf_rdma.errors.BackendUnavailableError: "), last_line
    assert f"TF_RDMA_BACKEND=verbs but that backend is not available: {why}" in last_line, last_line
    code, text = report["info"]
    assert code == 0 and f"  verbs  unavailable: {why}\n" in text and "  tcp    available\n" in text, text
    assert report["mapped"] == [], report["mapped"]


def test_with_rdma_core_present_verbs_gets_past_loading_it():
    # Here the libraries load; what verbs then lacks (no RDMA device on the development machines)
    # is another reason, and where a device works this is OK.
    usable, why = _transport.backend_available("verbs")
    assert usable or ("runtime libraries" not in why and "this tf_rdma build has no verbs" not in why), why
