"""How tf_rdma.Server derives every task's tf_rdma endpoint and the cluster key from the cluster."""
import pytest
import tensorflow as tf

from tf_rdma import ConfigError, Server
from tf_rdma.server import cluster_key, cluster_tasks

CLUSTER = tf.train.ClusterSpec({"chief": ["localhost:2221"], "ps": ["localhost:2222"],
                                "worker": ["localhost:2223", "10.0.0.5:2224"]})


def test_classic_consecutive_ports_need_no_configuration():
    tasks = cluster_tasks(CLUSTER, port_offset=1000)
    assert tasks == [
        ("/job:ps/replica:0/task:0", "localhost", 2222, 3222),
        ("/job:worker/replica:0/task:0", "localhost", 2223, 3223),
        ("/job:worker/replica:0/task:1", "10.0.0.5", 2224, 3224),
    ], "chief is a client: its transfers stay on gRPC in every process"


def test_explicit_address_overrides_the_offset():
    tasks = cluster_tasks(CLUSTER, {"/job:ps/replica:0/task:0": "localhost:9999"}, port_offset=1000)
    assert tasks[0][3] == 9999


@pytest.mark.parametrize("overrides, message", [
    ({"/job:ps/replica:0/task:7": "localhost:1"}, "not in the cluster"),
    ({"/job:ps/replica:0/task:0": "otherhost:1"}, "must use the task's host"),
    ({"/job:ps/replica:0/task:0": "nonsense"}, "not host:port"),
])
def test_bad_overrides_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cluster_tasks(CLUSTER, overrides, port_offset=1000)


def test_offset_past_the_last_port_is_refused():
    with pytest.raises(ConfigError, match="TF_RDMA_PORT_OFFSET"):
        cluster_tasks(tf.train.ClusterSpec({"ps": ["localhost:65000"]}), port_offset=1000)


def test_cluster_key_depends_on_the_cluster_and_the_secret(monkeypatch):
    tasks = cluster_tasks(CLUSTER, port_offset=1000)
    key = cluster_key(tasks)
    assert key != cluster_key(tasks[:2])
    monkeypatch.setenv("TF_RDMA_SECRET", "s3cret")
    assert cluster_key(tasks) != key


@pytest.mark.parametrize("tf_config, message", [
    ("", "TF_CONFIG is not set"),
    ("{not json", "not a valid cluster description"),
    ('{"cluster": {"ps": ["localhost:1"]}}', "not a valid cluster description"),
])
def test_tf_config_errors_say_what_is_wrong(tf_config, message):
    with pytest.raises(ConfigError, match=message):
        Server.from_tf_config(tf_config)
