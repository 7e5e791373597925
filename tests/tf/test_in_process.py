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


# Two tf_rdma servers exchange a tensor over tcp; the Python bindings then read the transport's
# process-wide counters. There is one transport core in a process, in tf_rdma's shared library,
# so the bindings count the connections TensorFlow's servers made and accepted.
ONE_CORE_PROGRAM = """
import json
import tensorflow as tf
import tf_rdma
from tf_rdma import _transport
from tf_rdma.ports import free_ports

before = _transport.stream_stats()
ps_port, worker_port = free_ports(2, also_free_at_offset=1000)
cluster = {"ps": [f"localhost:{ps_port}"], "worker": [f"localhost:{worker_port}"]}
servers = [tf_rdma.Server(cluster, job_name=job, task_index=0) for job in ("ps", "worker")]
tf.compat.v1.disable_eager_execution()
with tf.device("/job:ps/task:0"):
    weights = tf.Variable(tf.ones([100, 10]))
with tf.device("/job:worker/task:0"):
    total = tf.reduce_sum(weights * 2.0)
with tf.compat.v1.Session(servers[1].target) as session:
    session.run(weights.initializer)
    result = float(session.run(total))
print(json.dumps({"result": result, "before": before, "after": _transport.stream_stats(),
                  "servers": tf_rdma.stats()["servers"]}))
"""


def test_the_python_bindings_count_tensorflows_connections():
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    environment.update(TF_RDMA_BACKEND="tcp", TF_RDMA_PORT_OFFSET="1000", TF_CPP_MIN_LOG_LEVEL="1")
    ran = subprocess.run([sys.executable, "-c", ONE_CORE_PROGRAM], capture_output=True, text=True, timeout=180,
                         env=environment)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert report["result"] == 2000.0, report
    peers = [peer for server in report["servers"] for peer in server["peers"].values()]
    assert peers and all(peer["backend"] == "tcp" for peer in peers), report
    # A server counts the connections it made and those it accepted: here both ends of each; and
    # apart, those that only asked the peer to dial back (the worker calls the ps first).
    connects = sum(peer["connects"] for peer in peers)
    probes = sum(peer["probes"] for peer in peers)
    assert connects >= 2, report
    assert report["after"]["tcp_connections"] - report["before"]["tcp_connections"] == connects + probes, report
