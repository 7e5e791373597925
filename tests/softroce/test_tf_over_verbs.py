"""End to end over verbs on a real kernel RDMA stack: a two-process TF1 session whose cross-task
tensors (every dtype, scalars, empty tensors, changing shapes, cond, while, concurrent runs) go over
RDMA, bit-identical to the same program over gRPC on the host."""
import json
from pathlib import Path

import sys

from guest_loader import PYTHON, REPO

sys.path.insert(0, str(REPO / "tests" / "tf"))
from cluster import Cluster, digest  # noqa: E402

BIG_MIB = 1  # rxe under qemu TCG moves ~20 MB/s: the 256 MiB case runs on tcp and shm instead


def test_tf1_session_over_verbs_is_bit_identical_to_grpc(on_rdma, tmp_path):
    reference = str(tmp_path / "grpc.npz")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}) as cluster:
        cluster.start("ps", 0, "serve", transport="grpc")
        cluster.start("worker", 0, "compare_worker", transport="grpc", output=reference, big_mib=BIG_MIB)
        assert cluster.wait("worker", 0, timeout=300) == 0, cluster.log("worker", 0)[-3000:]

    code, output = on_rdma([PYTHON, str(Path(__file__).with_name("tf_over_verbs.py")), "10.77.0.1",
                            str(BIG_MIB)], timeout=1800)
    assert code == 0, output[-6000:]
    result = json.loads(next(l for l in output.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert result["digest"] == digest(reference)
    peer = result["stats"]["peers"]["/job:ps/replica:0/task:0"]
    assert peer["backend"] == "verbs", peer
    assert peer["tensors_received"] > 0 and peer["tensors_sent"] > 0 and peer["dead_tensors"] > 0
