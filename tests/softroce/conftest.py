"""The Soft-RoCE guest for the tests that need a real kernel RDMA stack.

On a host with a usable RDMA device, `on_rdma` runs the command right here instead. Without the
guest's packages the tests are skipped, except under CI, where that is a failure: CI must never
pass the verbs suite by not running it.
"""
from __future__ import annotations

import os
import subprocess
import pytest

from tests.softroce.guest_loader import REPO, guest, in_ci


@pytest.fixture(scope="session")
def softroce():
    missing = guest.missing_prerequisites()
    if missing:
        message = "Soft-RoCE harness prerequisites missing:\n  " + "\n  ".join(missing)
        if in_ci():
            pytest.fail(message + "\n(CI is set: missing prerequisites are a failure, not a skip)")
        pytest.skip(message)
    guest.ensure_artifacts()  # build vmlinux + initramfs outside of the timed runs
    return guest


@pytest.fixture(scope="session")
def on_rdma(request):
    """run(cmd, timeout, env) -> (returncode, output) where verbs works: natively if this host has
    an RDMA device, else in the Soft-RoCE guest (at 10.77.0.1)."""
    if guest.native_rdma_available():
        def run_native(cmd, timeout, env=None):
            result = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            return result.returncode, result.stdout
        return run_native
    harness = request.getfixturevalue("softroce")

    def run_in_guest(cmd, timeout, env=None):
        result = harness.run(cmd, timeout=timeout, env={"TFRDMA_TEST_HOST": "10.77.0.1", **(env or {})},
                             cwd=str(REPO))
        return result.returncode, result.output
    return run_in_guest
