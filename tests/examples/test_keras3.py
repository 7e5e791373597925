"""examples/tf2_keras3_custom_loop.py: Keras 3 custom loops under tf_rdma's MultiWorkerMirroredStrategy
(bit-identical to stock gRPC) and ParameterServerStrategy (the same bits over tcp and shm), over
tcp and shm, with every cross-task tensor on tf_rdma."""
import json

import pytest

from tests.examples.test_examples import assert_all_gone, run_example
from tests.tf.programs.cluster import digest

pytestmark = pytest.mark.examples

BACKENDS = ("tcp", "shm")
STEPS = 12


def train(tmp_path, strategy, transport, backend=None):
    """One --launch-local run (a small MLP, STEPS steps): its summary, and the digest of the
    trainer's final weights and per-step losses."""
    saved = tmp_path / f"{strategy}-{transport}-{backend}.npz"
    env = {"TF_RDMA_BACKEND": backend} if backend else {}
    proc = run_example("tf2_keras3_custom_loop.py", "--launch-local", "--strategy", strategy,
                       "--transport", transport, "--steps", STEPS, "--hidden", "256,256",
                       "--save", saved, "--json", timeout=140, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    result = summary["result"]
    assert result["keras"].startswith("3."), result
    assert result["optimizer_iterations"] == STEPS, result
    assert result["last_loss"] < 0.5 * result["first_loss"] and result["final_test_accuracy"] >= 0.7, result
    assert_all_gone(summary["pids"])
    return summary, digest(saved)


def assert_carried_by(backend, rdma_stats, tasks):
    assert sorted(rdma_stats) == sorted(tasks), rdma_stats
    for task, stats in rdma_stats.items():
        assert stats["backends"] == [backend], (task, stats)
        assert stats["left_on_grpc"] == {} and stats["errors"] == 0, (task, stats)
        assert stats["bytes_sent"] > 0 and stats["bytes_received"] > 0, (task, stats)


@pytest.mark.timeout(450)
def test_mirrored_custom_loop_is_bit_identical_to_grpc_over_tcp_and_shm(tmp_path):
    _, reference = train(tmp_path, "mwms", "grpc")
    for backend in BACKENDS:
        summary, ours = train(tmp_path, "mwms", "rdma", backend)
        assert ours == reference, backend
        # Each step all-reduces the MLP's gradients (85 K float32 parameters) between the workers.
        assert_carried_by(backend, summary["rdma_stats"], ["worker0", "worker1"])
        assert all(s["bytes_received"] >= STEPS * 85_000 * 4 for s in summary["rdma_stats"].values())


@pytest.mark.timeout(300)
def test_parameter_server_custom_loop_trains_over_tcp_and_shm_to_the_same_bits(tmp_path):
    digests = {}
    for backend in BACKENDS:
        summary, digests[backend] = train(tmp_path, "ps", "rdma", backend)
        # The worker reads the variables from the ps and sends it the gradients every step; the
        # coordinator creates and reads the variables through the ps too.
        assert_carried_by(backend, summary["rdma_stats"], ["ps0", "worker0", "chief"])
        worker = summary["rdma_stats"]["worker0"]
        assert worker["bytes_received"] >= STEPS * 85_000 * 4 and worker["bytes_sent"] >= STEPS * 85_000 * 4
    assert digests["tcp"] == digests["shm"]
