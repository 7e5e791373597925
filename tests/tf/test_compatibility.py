"""What tf.distribute.Server users rely on, kept by tf_rdma.Server: servers on any free port, and
TensorFlow's error classes."""
import json
import time
from pathlib import Path

from tests.tf.programs.cluster import PROGRAMS, Cluster

PROGRAM = PROGRAMS / "compat.py"


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


RENAMED = "a session that renames the tasks (ClusterSpec propagation): a tf_rdma server has one task name"


def test_a_session_with_its_own_cluster_runs_over_grpc_counted(tmp_path):
    """ClusterSpec propagation: servers started as their own local clusters, joined by a session's
    cluster_def under other names. tf_rdma cannot carry tasks it knows by another name; the session
    works as with TensorFlow, over gRPC, and says so."""
    output = str(tmp_path / "session.json")
    stats_files = [str(tmp_path / f"server{i}.json") for i in range(2)]
    with Cluster(tmp_path, {"server": 2, "client": 1}) as cluster:
        for index, stats_file in enumerate(stats_files):
            cluster.start("server", index, "serve_as_local_server", program=PROGRAM, stats_file=stats_file)
        cluster.start("client", 0, "session_with_its_own_cluster", program=PROGRAM, output=output)
        assert cluster.wait("client", 0, timeout=180) == 0, cluster.log("client", 0)[-3000:]
        with open(output) as f:
            assert json.load(f) == {"sum": 999000.0}
        for index, stats_file in enumerate(stats_files):
            cluster.wait_for_output("server", index, "ClusterSpec propagation", timeout=30)
            deadline = time.monotonic() + 10
            while json.loads(Path(stats_file).read_text())["fallback"].get(RENAMED, 0) == 0:
                assert time.monotonic() < deadline, Path(stats_file).read_text()
                time.sleep(0.2)


def test_an_eager_client_renaming_jobs_runs_over_grpc_counted(tmp_path):
    output = str(tmp_path / "renamed.json")
    with Cluster(tmp_path, {"worker": 2, "client": 1}) as cluster:
        for index in range(2):
            cluster.start("worker", index, "serve")
        cluster.start("client", 0, "eager_client_renaming_jobs", program=PROGRAM, output=output)
        assert cluster.wait("client", 0, timeout=180) == 0, cluster.log("client", 0)[-3000:]
        assert "is served by the tf_rdma server of task /job:worker" in cluster.log("client", 0)
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["sums"] == {"trainer": 999000.0, "aaa": 999000.0}, outcome
    for server in outcome["stats"]["servers"]:
        assert server["fallback"].get(RENAMED, 0) >= 1, server
