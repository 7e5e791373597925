"""What tf.distribute.Server users rely on, kept by tf_rdma.Server: servers on any free port, and
TensorFlow's error classes."""
import json
from pathlib import Path

from cluster import Cluster

PROGRAM = Path(__file__).with_name("compat_programs.py")


def run_alone(tmp_path, function):
    output = str(tmp_path / f"{function}.json")
    with Cluster(tmp_path, {"local": 1}) as cluster:
        cluster.start("local", 0, function, program=PROGRAM, output=output)
        assert cluster.wait("local", 0, timeout=120) == 0, cluster.log("local", 0)[-3000:]
    with open(output) as f:
        return json.load(f)


def test_two_servers_on_any_free_port_in_one_process(tmp_path):
    targets = run_alone(tmp_path, "two_servers_on_any_free_port")["targets"]
    assert len(set(targets)) == 2 and all(t.startswith("grpc://localhost:") for t in targets), targets


def test_a_malformed_address_raises_tensorflows_error_class(tmp_path):
    outcome = run_alone(tmp_path, "error_class")
    assert outcome["error"] == "InvalidArgumentError", outcome
    assert "no-port-here" in outcome["message"], outcome
