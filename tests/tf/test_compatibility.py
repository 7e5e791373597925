"""What tf.distribute.Server users rely on, kept by tf_rdma.Server: servers on any free port, and
TensorFlow's error classes."""
import json
from pathlib import Path

from cluster import Cluster

PROGRAM = Path(__file__).with_name("compat_programs.py")


def run_alone(tmp_path, function, jobs=None):
    output = str(tmp_path / f"{function}.json")
    with Cluster(tmp_path, jobs or {"local": 1}) as cluster:
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


def test_a_second_server_for_a_task_raises_tensorflows_error_class(tmp_path):
    outcome = run_alone(tmp_path, "second_server_for_a_task", jobs={"local": 1, "stock": 1, "tf_rdma": 1})
    assert outcome["stock"]["error"] == outcome["tf_rdma"]["error"] == "UnknownError", outcome
    assert "Address already in use" in outcome["tf_rdma"]["message"], outcome


def test_one_client_connects_to_two_clusters_of_different_shapes(tmp_path):
    output = str(tmp_path / "two_clusters.json")
    with Cluster(tmp_path, {"one": 1, "two": 2, "client": 1}) as cluster:
        for job, index in (("one", 0), ("two", 0), ("two", 1)):
            cluster.start(job, index, "serve")
        cluster.start("client", 0, "two_clusters_one_after_the_other", program=PROGRAM, output=output)
        assert cluster.wait("client", 0, timeout=180) == 0, cluster.log("client", 0)[-3000:]
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["sums"] == {"one/0": 999000.0, "two/0": 999000.0, "two/1": 1498500.0}, outcome
    # One client server per connect, each carrying its cluster's tensors over tf_rdma.
    servers = outcome["stats"]["servers"]
    peers = [set(server["peers"]) for server in servers]
    assert peers == [{"/job:one/replica:0/task:0"},
                     {"/job:two/replica:0/task:0", "/job:two/replica:0/task:1"}], outcome
    for server in servers:
        assert server["fallback"] == {}, server
        assert all(p["bytes_received"] >= 4000 for p in server["peers"].values()), server
