import os
import sys

# What TensorFlow's and absl's C++ logging show is part of what the tests check (tf_rdma logs
# through it: a refused peer's warning, a lost connection): a user's shell setting such as
# TF_CPP_MIN_LOG_LEVEL=2 must not change it. Gone before anything loads tf_rdma or TensorFlow, so
# this process and every process the tests start log at TensorFlow's defaults unless a test says
# otherwise.
for _variable in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MIN_VLOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE",
                  "TF_CPP_LOG_THREAD_ID"):
    os.environ.pop(_variable, None)

from tests import OPTIONAL_PACKAGES, REPO  # noqa: E402
from tf_rdma.transport import BACKENDS, STREAM_BACKENDS

# The programs the tests start (`python -m tests.…`) import the shared helpers as the tests do.
# tests/tensorflow_versions takes it off again: its venvs' own tf_rdma must not be shadowed.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
# The tests that draw a bench's plot do so in this process (matplotlib); not on PYTHONPATH, so
# that the processes the tests start do not import it.
sys.path.append(str(OPTIONAL_PACKAGES))


def pytest_addoption(parser):
    parser.addoption(
        "--backends", default=",".join(STREAM_BACKENDS),
        help=f"comma-separated backends for the backend-independent suites, of {', '.join(BACKENDS)} "
             f"(default {','.join(STREAM_BACKENDS)}, those every Linux host runs; the Soft-RoCE run "
             "passes verbs)")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        backends = [b for b in metafunc.config.getoption("backends").split(",") if b]
        stream = [b for b in backends if b in STREAM_BACKENDS]
        # Suites that speak the socket wire format directly apply to stream backends only.
        marker = metafunc.definition.get_closest_marker("stream_backends_only")
        metafunc.parametrize("backend", stream if marker else backends)


def pytest_configure(config):
    config.addinivalue_line("markers", f"stream_backends_only: raw-socket tests ({', '.join(STREAM_BACKENDS)})")
    config.addinivalue_line("markers", "without_rdma_core: runs with rdma-core hidden, so it uses no RDMA "
                                       "device: the host's run has it")
    config.addinivalue_line("markers", "peer_process: the peer runs in a process of its own (helpers."
                                       "start_peer); the two-host run puts it on the other host")
    config.addinivalue_line("markers", "flaps_rdma_link: takes an RDMA link down and up; runs after "
                                       "every other test")


def pytest_collection_modifyitems(config, items):
    # A raw-socket test has no backend to run over when only verbs is asked for, and a test that
    # hides rdma-core has nothing to gain from an RDMA device (and costs a TensorFlow import, minutes
    # under the Soft-RoCE guest's emulation): they are left out, not reported skipped (the Soft-RoCE
    # suite allows no skip).
    if not any(b in STREAM_BACKENDS for b in config.getoption("backends").split(",")):
        items[:] = [item for item in items if item.get_closest_marker("stream_backends_only") is None
                    and item.get_closest_marker("without_rdma_core") is None]
    # After a link flap with live connections, rdma_cm on Soft-RoCE connects nothing more in the
    # same guest (a kernel rxe quirk): such tests go last, whatever file sorts after theirs.
    items.sort(key=lambda item: item.get_closest_marker("flaps_rdma_link") is not None)
