"""How tf_rdma's servers derive every task's tf_rdma endpoint from the cluster, and a cluster started
that way."""
import json

import pytest
import tensorflow as tf

from tests.tf.programs.cluster import Cluster, free_ports

from tf_rdma import ConfigError, Server
from tf_rdma.server import cluster_tasks

CLUSTER = tf.train.ClusterSpec({"chief": ["localhost:2221"], "ps": ["localhost:2222"],
                                "worker": ["localhost:2223", "10.0.0.5:2224"]})


def test_classic_consecutive_ports_need_no_configuration():
    assert cluster_tasks(CLUSTER) == [
        ("/job:chief/replica:0/task:0", "localhost", 2221, 3221),
        ("/job:ps/replica:0/task:0", "localhost", 2222, 3222),
        ("/job:worker/replica:0/task:0", "localhost", 2223, 3223),
        ("/job:worker/replica:0/task:1", "10.0.0.5", 2224, 3224),
    ]


def test_port_offset_comes_from_the_environment_and_may_be_negative(monkeypatch):
    monkeypatch.setenv("TF_RDMA_PORT_OFFSET", "-100")
    assert [t[3] for t in cluster_tasks(CLUSTER)] == [2121, 2122, 2123, 2124]


def test_a_server_on_any_free_port_listens_on_any_free_port():
    assert cluster_tasks({"worker": ["localhost:0"]}) == [("/job:worker/replica:0/task:0", "localhost", 0, 0)]


def test_explicit_address_overrides_the_offset():
    tasks = cluster_tasks(CLUSTER, {"/job:ps/replica:0/task:0": "localhost:9999"})
    assert tasks[1][3] == 9999


@pytest.mark.parametrize("overrides, message", [
    ({"/job:ps/replica:0/task:7": "localhost:1"}, "not in the cluster"),
    ({"/job:ps/replica:0/task:0": "otherhost:1"}, "on the task's host"),
    ({"/job:ps/replica:0/task:0": "nonsense"}, "on the task's host"),
])
def test_bad_overrides_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cluster_tasks(CLUSTER, overrides)


def test_offset_past_the_last_port_is_refused():
    with pytest.raises(ConfigError, match="TF_RDMA_PORT_OFFSET"):
        cluster_tasks({"ps": ["localhost:65000"]})


@pytest.mark.parametrize("tf_config, message", [
    ("", "TF_CONFIG is not set"),
    ("{not json", "not a valid cluster description"),
    ('{"cluster": {"ps": ["localhost:1"]}}', "not a valid cluster description"),
])
def test_tf_config_errors_say_what_is_wrong(tf_config, message):
    with pytest.raises(ConfigError, match=message):
        Server.from_tf_config(tf_config)


def listening_tcp_ports():
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.timeout(200)
def test_from_tf_config_rdma_addresses_and_a_negative_offset_in_a_running_cluster(tmp_path):
    """Every task built by Server.from_tf_config from its TF_CONFIG, TF_RDMA_PORT_OFFSET=-500 from
    the environment, and rdma_addresses moving the ps's listener: the tasks find each other."""
    offset = -500
    ps_port, _ = free_ports(2, offset)  # the second: a port for the ps's listener (not port + offset)
    output = str(tmp_path / "outcome.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, {"TF_RDMA_PORT_OFFSET": str(offset)}) as cluster:
        ps_address = f"localhost:{ps_port}"
        overrides = {"/job:ps/replica:0/task:0": ps_address}
        for job, function, extra in (("ps", "serve", {}), ("worker", "cross_once", {"output": output})):
            tf_config = json.dumps({"cluster": cluster.spec, "task": {"type": job, "index": 0}})
            cluster.start(job, 0, function, transport="rdma", env={"TF_CONFIG": tf_config},
                          from_tf_config=True, rdma_addresses=overrides, **extra)
        assert cluster.wait("worker", 0, timeout=150) == 0, cluster.log("worker", 0)[-3000:]
        ps_grpc_port = int(cluster.spec["ps"][0].rsplit(":", 1)[1])
        listening = listening_tcp_ports()
        assert ps_port in listening and ps_grpc_port + offset not in listening, cluster.log("ps", 0)[-3000:]
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["error"] is None and outcome["sum"] == 2 * sum(range(1000)), outcome
    # The ps connected to the worker at the worker's port - 500, and the tensor came over it.
    stats = outcome["stats"]
    assert stats["task"] == "/job:worker/replica:0/task:0", stats
    assert stats["peers"]["/job:ps/replica:0/task:0"]["bytes_received"] >= 4000, stats
