"""What the verbs tests share: whether verbs works here, and the pyverbs peer's interpreter."""
import os
import subprocess

import pytest

from tf_rdma import _transport

VERBS_OK, VERBS_WHY_NOT = _transport.backend_available("verbs")
# Where verbs cannot work (no RDMA device), tests/softroce/test_verbs_suite.py runs these in a
# Soft-RoCE guest instead.
needs_verbs = pytest.mark.skipif(not VERBS_OK, reason=f"verbs unavailable here ({VERBS_WHY_NOT}); "
                                 "they run in the Soft-RoCE guest")

PYVERBS_PYTHON = "/usr/bin/python3"  # Debian's interpreter, where python3-pyverbs installs
HOSTILE_PEER = "tests.transport.verbs.hostile_verbs_peer"  # a module: python -m


def require_pyverbs():
    """Skips without pyverbs, except under CI, where the hostile-peer tests must run."""
    probe = subprocess.run([PYVERBS_PYTHON, "-c", "import pyverbs.cmid"], capture_output=True, text=True)
    if probe.returncode == 0:
        return
    message = (f"pyverbs is missing ({(probe.stderr.strip().splitlines() or ['?'])[-1]}); "
               "tools/softroce/install.sh installs python3-pyverbs")
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set: the hostile verbs peer's tests must run)")
    pytest.skip(message)
