"""What a holder of the cluster key can and cannot do to a running tf_rdma cluster."""
import json
import time
from pathlib import Path

import pytest

from cluster import Cluster
from tf_rdma import _transport
from tf_rdma.config import load_config

PROGRAM = Path(__file__).with_name("security_programs.py")


def test_a_key_holder_cannot_take_over_a_live_tasks_connection(tmp_path):
    """An impersonator claiming the ps's name to the worker, while the ps is connected, is refused;
    the worker's steps go on over the real ps's connection."""
    output = str(tmp_path / "steps.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}) as cluster:
        cluster.start("ps", 0, "serve")
        cluster.start("worker", 0, "steps_for", program=PROGRAM, output=output, seconds=6)
        cluster.wait_for_output("worker", 0, "warm", timeout=120)
        key = load_config().cluster_key("tf_rdma cluster key")  # what every task derives from TF_RDMA_SECRET
        impostor = _transport.Transport("tcp", name="/job:ps/replica:0/task:0", cluster_key=key)
        host, port = cluster.spec["worker"][0].split(":")
        connection = impostor.connect(f"{host}:{int(port) + load_config().port_offset}")
        with pytest.raises(Exception, match="already, and that connection is alive"):
            for _ in range(100):
                connection.check()
                time.sleep(0.05)
        assert cluster.wait("worker", 0, timeout=60) == 0, cluster.log("worker", 0)[-3000:]
        assert "refused a second connection claiming to be task /job:ps/replica:0/task:0" in cluster.log("worker", 0)
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["error"] is None and outcome["steps"] > 10, outcome
