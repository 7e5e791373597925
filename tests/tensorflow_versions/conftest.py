"""The matrix's venvs are made and built into in the background from the session's start, at the
lowest CPU priority (SCHED_IDLE: it runs only on a core nothing else wants, such as the one the
Soft-RoCE guest's transport suite leaves idle, or while fault tests wait out their timeouts), and
the matrix runs last: a fresh machine downloads six TensorFlow wheels and builds tf_rdma six times,
minutes of CI that would otherwise come on top of the rest.

tools/run_tests.sh starts that preparation itself, before anything else, and names its build in
TFRDMA_TEST_VERSIONS_BUILD_ID; a session without it starts its own. Under pytest-xdist the workers
share one build ID (the run's), and only the first worker starts the preparation."""
import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from tests import REPO
from tools import tensorflow_versions

MATRIX_TEST = "test_tf_rdma_installs_and_carries_tensors_on"
BUILD_ID_VARIABLE = "TFRDMA_TEST_VERSIONS_BUILD_ID"
_preparation = {}


def _at_lowest_priority():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` deselected theirs
def pytest_collection_modifyitems(config, items):
    matrix = [item for item in items if item.originalname == MATRIX_TEST]
    if not matrix or config.option.collectonly:
        return
    items[:] = [item for item in items if item.originalname != MATRIX_TEST] + matrix
    started_outside = os.environ.get(BUILD_ID_VARIABLE)
    if started_outside:
        _preparation["build_id"] = started_outside
        return
    workerinput = getattr(config, "workerinput", None)  # set in a pytest-xdist worker
    _preparation["build_id"] = workerinput["testrunuid"] if workerinput else uuid.uuid4().hex
    if workerinput and workerinput["workerid"] != "gw0":
        return
    wheels = [item.callspec.params["wheel"] for item in matrix]
    log = tensorflow_versions.cache_root() / "prepare.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # Its disk writes (six venvs, 11 GiB unpacked) wait for everyone else's too.
    idle_io = ["ionice", "-c", "3"] if shutil.which("ionice") else []
    with open(log, "w") as out:
        _preparation["process"] = subprocess.Popen(
            [*idle_io, sys.executable, str(REPO / "tools" / "tensorflow_versions.py"), "prepare", "--build-id",
             _preparation["build_id"], *wheels], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            preexec_fn=_at_lowest_priority, start_new_session=True)


@pytest.fixture
def matrix_build_id():
    """The background build's ID: a venv it built for this session is used as it is."""
    return _preparation.get("build_id")


def pytest_sessionfinish(session):
    process = _preparation.pop("process", None)
    if process and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # a run that ended early: pip and the compilers too
        process.wait()
