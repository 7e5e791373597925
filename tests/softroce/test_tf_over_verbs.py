"""End to end over verbs on a real kernel RDMA stack: a MultiWorkerMirroredStrategy all-reduce
between two workers whose collective buffers go over RDMA, bit-identical to the same program over
gRPC on the host.

Every TensorFlow process costs a minute and a half of emulated CPU here, so what is not verbs'
own is checked where it is cheap: a TF1 session over verbs runs across the two guests
(test_two_hosts.py, one TensorFlow process per guest), every dtype and control-flow construct on
tcp and shm (tests/tf/test_tf1.py: the TensorFlow side is the same code for every backend); a spec
that says 127.0.0.1 (no RDMA device reaches it) fails at once, naming the devices, in the
transport's verbs tests in the guest (tests/transport/verbs/test_verbs.py, no TensorFlow); the
first step's error for a task running TensorFlow without tf_rdma comes from a TCP probe that is
the same for every backend (tests/tf/test_tf1.py)."""
import json

import pytest

from tests.softroce.guest_loader import PYTHON
from tests.tf.programs.cluster import PROGRAMS, Cluster, digest

STEPS, ELEMENTS = 3, 1 << 16  # all-reduces of 256 KiB
COLLECTIVE_PROGRAM = PROGRAMS / "collective.py"


def grpc_references(tmp_path):
    outputs = [str(tmp_path / f"grpc-all-reduce-{i}.npz") for i in range(2)]
    with Cluster(tmp_path, {"worker": 2}) as cluster:
        for i in range(2):
            cluster.start("worker", i, "all_reduce_worker", program=COLLECTIVE_PROGRAM, transport="grpc",
                          output=outputs[i], steps=STEPS, elements=ELEMENTS)
        for i in range(2):
            assert cluster.wait("worker", i, timeout=300) == 0, cluster.log("worker", i)[-3000:]
    return [digest(o) for o in outputs]


# Above the sum of this test's own waits (the references, the guest), so they fail first, with the output.
@pytest.mark.timeout(1300)
def test_all_reduce_over_verbs_is_bit_identical_to_grpc(on_rdma, tmp_path):
    references = grpc_references(tmp_path)

    code, output = on_rdma([PYTHON, "-m", "tests.softroce.tf_over_verbs", "10.77.0.1", str(STEPS), str(ELEMENTS)],
                           timeout=900)
    assert code == 0, output[-6000:]
    result = json.loads(next(l for l in output.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert result["digests"] == references
    peer = result["stats"]["peers"]["/job:worker/replica:0/task:1"]
    assert peer["backend"] == "verbs", peer
    # Two workers: each receives half the vector twice (reduce-scatter, all-gather) per step.
    assert peer["bytes_received_by_kind"]["collective"] >= STEPS * ELEMENTS * 4, peer
