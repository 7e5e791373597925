"""Several tf_rdma servers in one process, as TensorFlow's own distributed tests and many users'
tests build clusters: each server owns its endpoint, and the tensors between them cross over
tf_rdma exactly as between processes."""
import json
import os
import subprocess
import sys

import pytest

from tests.tf.programs.cluster import PROGRAMS, digest

PROGRAM = PROGRAMS / "in_process_cluster.py"


def run(tmp_path, transport):
    output = str(tmp_path / f"{transport}.npz")
    result = subprocess.run([sys.executable, str(PROGRAM), transport, output], capture_output=True,
                            text=True, timeout=180, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return output


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(2 * 180 + 60)
def test_three_servers_in_one_process_train_like_grpc(tmp_path):
    reference = run(tmp_path, "grpc")
    output = run(tmp_path, "rdma")
    assert digest(output) == digest(reference)
    with open(output + ".stats.json") as f:
        servers = {s["task"]: s for s in json.load(f)["servers"]}
    assert sorted(servers) == ["/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0",
                               "/job:worker/replica:0/task:1"]
    ps = "/job:ps/replica:0/task:0"
    for worker in ("/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"):
        # 20 steps: the weights (100x10 floats) to each worker, and their gradients back.
        from_ps = servers[worker]["peers"][ps]
        assert from_ps["tensors_received"] >= 20 and from_ps["bytes_received"] >= 20 * 4000, from_ps
        to_ps = servers[ps]["peers"][worker]
        assert to_ps["bytes_received"] >= 20 * 4000, to_ps
        assert from_ps["errors"] == to_ps["errors"] == 0
