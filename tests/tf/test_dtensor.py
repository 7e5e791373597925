"""DTensor multi-client on tf_rdma (tf_rdma.dtensor.initialize_accelerator_system): two clients of a
4-device CPU mesh compute a batch-sharded matmul, sums across the clients (all-reduce) and the
product gathered onto every device (all-gather) bit for bit as over stock gRPC, with the collectives
carried by tf_rdma; a client killed mid-step fails the other with an error naming it. One cluster
per backend serves both checks."""
import json
import signal
import time
from pathlib import Path

import pytest

from tests.tf.programs.cluster import PROGRAMS, Cluster, digest

PROGRAM = PROGRAMS / "dtensor_clients.py"
STEPS = 3
KILLED = "/job:worker/replica:0/task:1"


def start_clients(cluster, tmp_path, transport):
    outputs = [str(tmp_path / f"{transport}-client{i}.npz") for i in range(2)]
    for i in range(2):
        cluster.start("worker", i, "client", program=PROGRAM, transport=transport, output=outputs[i], steps=STEPS)
    for i in range(2):
        cluster.wait_for_output("worker", i, "done", timeout=120)
    return outputs


@pytest.fixture(scope="module")
def grpc_digests(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("grpc")
    with Cluster(tmp_path, {"worker": 2}) as cluster:
        return [digest(output) for output in start_clients(cluster, tmp_path, "grpc")]


@pytest.mark.timeout(240)
def test_two_clients_compute_as_over_grpc_on_tf_rdma_and_a_killed_client_fails_the_other(tmp_path, backend, grpc_digests):
    with Cluster(tmp_path, {"worker": 2}, {"TF_RDMA_BACKEND": backend}) as cluster:
        outputs = start_clients(cluster, tmp_path, "rdma")
        # Both clients step on; client 1 dies in the middle of one.
        time.sleep(1.0)
        killed_at = time.time()
        cluster.signal("worker", 1, signal.SIGKILL)
        failure = Path(outputs[0] + ".failure.json")
        deadline = time.monotonic() + 60
        while not failure.exists():
            assert time.monotonic() < deadline, cluster.log("worker", 0)[-3000:]
            time.sleep(0.2)
    assert [digest(output) for output in outputs] == grpc_digests
    for output in outputs:
        with open(output + ".stats.json") as f:
            stats = json.load(f)
        assert stats and stats["fallback"] == {}, stats  # empty: no tf_rdma server ran
        (peer,) = stats["peers"].values()
        assert peer["backend"] == backend and peer["errors"] == 0, peer
        # Each step sums 64 KiB of columns over the 4 devices and gathers the 512 KiB product onto
        # each: whatever the algorithms, each client receives at least the other's 64 KiB of
        # partial sums and its 256 KiB of rows.
        assert peer["bytes_received_by_kind"].get("collective", 0) >= STEPS * (64 + 256) * 1024, peer
    outcome = json.loads(failure.read_text())
    assert outcome.get("error") == "UnavailableError", outcome
    assert KILLED in outcome["message"], outcome
    assert outcome["failed_at"] - killed_at < 10, outcome


def test_a_gpu_mesh_is_refused_naming_tensorflows_own_start(monkeypatch):
    monkeypatch.setenv("DTENSOR_JOBS", "localhost:1,localhost:2")
    import tf_rdma
    with pytest.raises(tf_rdma.ConfigError, match=r"tf\.experimental\.dtensor\.initialize_accelerator_system"):
        tf_rdma.dtensor.initialize_accelerator_system(device_type="GPU")
