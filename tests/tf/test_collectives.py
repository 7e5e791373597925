"""MultiWorkerMirroredStrategy on tf_rdma: all-reduces give the same bits as over gRPC with every
collective byte carried by tf_rdma, and a worker that dies or hangs mid all-reduce fails the
collective on the others promptly, with an error naming it."""
import json
import signal
import time
from pathlib import Path

import pytest

from tests.tf.programs.cluster import PROGRAMS, Cluster, digest

PROGRAM = PROGRAMS / "collective.py"
STEPS, ELEMENTS = 4, 1 << 20


def all_reduce(tmp_path, transport, backend=None, workers=2):
    env = {"TF_RDMA_BACKEND": backend} if backend else {}
    outputs = [str(tmp_path / f"{transport}-{backend}-{i}.npz") for i in range(workers)]
    with Cluster(tmp_path, {"worker": workers}, env) as cluster:
        for i in range(workers):
            cluster.start("worker", i, "all_reduce_worker", program=PROGRAM, transport=transport,
                          output=outputs[i], steps=STEPS, elements=ELEMENTS)
        for i in range(workers):
            assert cluster.wait("worker", i, timeout=240) == 0, cluster.log("worker", i)[-4000:]
    return outputs


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(2 * 3 * 240 + 60)
def test_all_reduce_is_bit_identical_to_grpc_and_carried_by_tf_rdma(tmp_path, backend):
    reference = all_reduce(tmp_path, "grpc", workers=3)
    outputs = all_reduce(tmp_path, "rdma", backend, workers=3)
    for ours, theirs in zip(outputs, reference):
        assert digest(ours) == digest(theirs)
    for i, output in enumerate(outputs):
        with open(output + ".stats.json") as f:
            stats = json.load(f)
        assert stats["fallback"] == {}, stats
        peers = stats["peers"]
        assert {p["backend"] for p in peers.values()} == {backend}, peers
        # A ring all-reduce across 3 workers receives 2 * 2/3 of the 4 MiB vector per step.
        received = sum(p["bytes_received_by_kind"].get("collective", 0) for p in peers.values())
        assert received >= 0.99 * STEPS * (ELEMENTS * 4) * 4 / 3, peers  # chunks split unevenly
        assert all(p["errors"] == 0 for p in peers.values()), peers
        # Group and instance resolution are worker-service calls on tf_rdma; only device discovery
        # stays on gRPC.
        assert all(set(p["calls_on_grpc"]) <= {"GetStatus"} for p in peers.values()), peers


@pytest.mark.parametrize("stop, env, within", [
    (signal.SIGKILL, {}, 10),
    (signal.SIGSTOP, {"TF_RDMA_PEER_TIMEOUT_MS": "3000"}, 12),
], ids=["killed", "hung"])
def test_a_worker_lost_mid_all_reduce_fails_the_others_naming_it(tmp_path, stop, env, within):
    outputs = [str(tmp_path / f"outcome-{i}.json") for i in range(3)]
    with Cluster(tmp_path, {"worker": 3}, env) as cluster:
        for i in range(3):
            cluster.start("worker", i, "all_reduce_until_failure", program=PROGRAM, transport="rdma",
                          output=outputs[i])
        for i in range(3):
            cluster.wait_for_output("worker", i, "warm", timeout=180)
        time.sleep(1.0)
        stopped_at = time.time()
        cluster.signal("worker", 2, stop)
        deadline = time.monotonic() + 120
        while not all(Path(o).exists() for o in outputs[:2]):
            assert time.monotonic() < deadline, cluster.log("worker", 0)[-3000:] + cluster.log("worker", 1)[-3000:]
            time.sleep(0.2)
    for i in range(2):
        with open(outputs[i]) as f:
            outcome = json.load(f)
        assert outcome, f"worker {i} never failed"
        assert outcome["error"] == "UnavailableError", outcome
        assert "/job:worker/replica:0/task:2" in outcome["message"], outcome
        # Whichever saw the loss first reports it (tf_rdma, or TensorFlow's own heartbeats); when
        # it is tf_rdma, the error carries the phrase TensorFlow's failure handling matches.
        if "tf_rdma:" in outcome["message"]:
            assert "GRPC error information from remote target /job:worker/replica:0/task:2" in outcome["message"]
        assert outcome["failed_at"] - stopped_at < within, outcome
