"""The backend-independent transport suites and the verbs-specific tests, with the verbs backend on
a real kernel RDMA stack: natively where this host has an RDMA device, else in the Soft-RoCE guest.
Nothing on this path may be skipped."""
import re

import pytest

from tests.softroce.guest_loader import PYTHON


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(1900)
def test_transport_suite_passes_on_verbs(on_rdma):
    code, output = on_rdma([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                            "tests/transport/test_transport.py", "tests/transport/test_scale.py",
                            "tests/transport/verbs",
                            "--backends", "verbs", "--durations=8"], timeout=1800)
    print(output[-3000:])  # the slowest tests in the guest, in a passing run's log too (-rP)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    assert code == 0, output[-8000:]
    assert re.search(r"\d+ passed", summary), summary
    assert not re.search(r"failed|skipped|error|deselected", summary), output[-8000:]
