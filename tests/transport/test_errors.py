"""How a C++ status becomes a Python exception (tf_rdma/errors.py: from_status): by the kind C++
marked where the failure arose, and by the status code only where none was marked."""
import subprocess
import sys

import pytest

from tf_rdma import errors

FAILED_PRECONDITION, PERMISSION_DENIED, UNAVAILABLE = 9, 7, 14


@pytest.mark.parametrize("kind, error_class", [
    ("handshake", errors.HandshakeError),
    ("missing_library", errors.MissingLibraryError),
    ("rdma_device_mismatch", errors.BackendUnavailableError),
])
def test_a_kind_decides_the_class_whatever_the_code(kind, error_class):
    for code in (FAILED_PRECONDITION, PERMISSION_DENIED, UNAVAILABLE):
        error = errors.from_status(code, "why", kind=kind)
        assert type(error) is error_class, (code, kind, error)
        assert str(error) == "why"


def test_a_failed_precondition_nobody_marked_is_no_handshake_error():
    # FAILED_PRECONDITION and PERMISSION_DENIED mean too many things to name one class.
    for code in (FAILED_PRECONDITION, PERMISSION_DENIED):
        assert type(errors.from_status(code, "why")) is errors.TransportError


def test_a_status_without_a_kind_goes_by_its_code():
    assert type(errors.from_status(UNAVAILABLE, "gone")) is errors.PeerUnavailableError
    assert type(errors.from_status(8, "too big", needed=4096)) is errors.MessageTooLargeError
    assert type(errors.from_status(8, "ulimit -l")) is errors.ResourceLimitError


def test_a_kind_this_python_side_does_not_know_is_a_transport_error():
    assert type(errors.from_status(FAILED_PRECONDITION, "why", kind="from a newer build")) is errors.TransportError


def test_a_libcrypto_lacking_what_the_handshake_needs_raises_missing_library_error(tmp_path):
    """A libcrypto.so.3 without OpenSSL's functions, found first on the library path: every transport
    refuses to start, naming the library, as MissingLibraryError (not a handshake's failure)."""
    stub = tmp_path / "libcrypto.so.3"
    source = tmp_path / "empty.c"
    source.write_text("int tf_rdma_test_nothing_here;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stub), str(source)], check=True)
    program = """
import tf_rdma
from tf_rdma import _transport
try:
    _transport.Transport("tcp", name="local", cluster_key=b"k" * 32)
except Exception as error:
    print(type(error).__name__, error)
else:
    print("started")
"""
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("MissingLibraryError "), run.stdout
    assert "libcrypto.so.3" in run.stdout, run.stdout
