"""How tf_rdma's servers derive every task's tf_rdma endpoint from the cluster."""
import pytest
import tensorflow as tf

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
