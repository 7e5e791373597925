"""`python -m tf_rdma doctor` against a running cluster: healthy, and each way a cluster breaks that
it must name with its fix (a task down, a task without tf_rdma, another secret, another wire
protocol, another task's name answering at a task's address, a locked-memory limit too low for
verbs), exit status 1 for every problem."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.tf.programs.cluster import Cluster, free_ports
from tests.transport import hostile_peer

from tf_rdma import _transport
from tf_rdma.config import load_config

SECRET = "3f8a0c6e1d2b4f5a6c7e8d9f0a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3"
OTHER_SECRET = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a29180716f5e4d3c2b1a0f9e8d7c6b5"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """ps0 and worker0 on tf_rdma, worker1 on stock TensorFlow."""
    tmp = tmp_path_factory.mktemp("doctor")
    with Cluster(tmp, {"ps": 1, "worker": 2}, {"TF_RDMA_SECRET": SECRET}) as running:
        running.start("ps", 0, "serve")
        running.start("worker", 0, "serve", stats_file=str(tmp / "worker0-stats.json"))
        running.start("worker", 1, "serve", transport="grpc")
        for job, index in (("ps", 0), ("worker", 0), ("worker", 1)):
            running.wait_for_output(job, index, "serving", timeout=120)
        yield running


def doctor(spec, secret=SECRET, wrapper=(), **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    environment.update({"TF_RDMA_SECRET": secret, "TF_RDMA_BACKEND": "tcp", **env})
    result = subprocess.run([*wrapper, sys.executable, "-m", "tf_rdma", "doctor", "--json",
                             "--cluster-spec", json.dumps(spec)], env=environment, capture_output=True, text=True,
                            timeout=120)
    report = json.loads(result.stdout) if result.stdout.strip() else None
    assert report is not None, result.stderr
    assert (result.returncode == 0) == report["healthy"], result
    return {t["task"]: t for t in report["tasks"]}, report


def test_a_healthy_cluster_passes(cluster):
    spec = {"ps": cluster.spec["ps"], "worker": cluster.spec["worker"][:1]}
    tasks, report = doctor(spec, TF_RDMA_BACKEND="auto")
    assert report["healthy"], report
    # The worker proved itself to the doctor and took it for no peer of its own (a doctor named as a
    # task, "/job:tf_rdma_doctor/...", sorted before it and was adopted as one that connects).
    on_worker = cluster.stats_dumped_after(str(cluster.tmp_path / "worker0-stats.json"), time.time())
    assert not on_worker["peers"], on_worker["peers"]
    for task in tasks.values():
        assert task["same_secret"] and task["grpc_answers"] and task["tf_rdma_answers"], task
        assert task["wire"] == str(_transport.PROTOCOL_VERSION), task
        assert task["build"] == f"{_transport.BUILD_VERSION}, TensorFlow {_transport.BUILT_WITH_TENSORFLOW}", task
        assert task["backend"] == "shm", task  # the same host, as auto chooses


def test_a_task_without_tf_rdma_and_a_task_not_running_are_named_with_their_fix(cluster):
    absent_port = free_ports(1)[0]
    spec = {**cluster.spec, "absent": [f"localhost:{absent_port}"]}
    tasks, report = doctor(spec)
    assert not report["healthy"]
    without = tasks["/job:worker/replica:0/task:1"]
    assert without["grpc_answers"] and not without["tf_rdma_answers"], without
    assert "runs TensorFlow without tf_rdma (use tf_rdma.Server" in without["problems"][0], without
    absent = tasks["/job:absent/replica:0/task:0"]
    assert f"nothing answers at localhost:{absent_port} (TensorFlow) nor at localhost:{absent_port + 1000}" \
        in absent["problems"][0], absent
    assert tasks["/job:ps/replica:0/task:0"]["problems"] == [], tasks


def test_another_secret_is_proved_without_revealing_either(cluster):
    spec = {"ps": cluster.spec["ps"]}
    tasks, report = doctor(spec, secret=OTHER_SECRET)
    ps = tasks["/job:ps/replica:0/task:0"]
    assert ps["same_secret"] is False and "holds another secret than this process" in ps["problems"][0], ps
    assert "TF_RDMA_SECRET_FILE" in ps["problems"][0] and SECRET not in json.dumps(report), ps


def test_another_wire_protocol_names_both_versions():
    port = free_ports(1)[0]
    key = load_config({"TF_RDMA_SECRET": SECRET}).cluster_key()
    old = _transport.Transport("tcp", name="/job:old/replica:0/task:0", cluster_key=key,
                               protocol_version=_transport.PROTOCOL_VERSION - 1)
    listener = old.listen(f"127.0.0.1:{port + 1000}")
    tasks, report = doctor({"old": [f"127.0.0.1:{port}"]})
    problem = tasks["/job:old/replica:0/task:0"]["problems"][0]
    assert f"it speaks wire protocol {_transport.PROTOCOL_VERSION} " in problem, problem
    assert f"(/job:old/replica:0/task:0) speaks {_transport.PROTOCOL_VERSION - 1} " in problem, problem
    assert "Install the same tf_rdma version in every task" in problem, problem
    del listener


def test_a_key_holder_answering_at_a_tasks_address_under_another_name_is_a_problem_naming_both():
    """A peer written from the wire format holds the secret and listens at the ps's tf_rdma address
    as /job:worker/replica:0/task:7: it proves the key, and the name it proves is not the ps's."""
    port = free_ports(1)[0]
    key = load_config({"TF_RDMA_SECRET": SECRET}).cluster_key()
    listening = socket.create_server(("127.0.0.1", port + 1000))
    squatter = "/job:worker/replica:0/task:7"
    answered = []
    # The doctor's check that the port answers is a connection and nothing more: it ends its answer.
    with hostile_peer.answering_each("tcp", listening,
                                     lambda peer: answered.append(peer.answer_handshake(key, squatter))):
        tasks, report = doctor({"ps": [f"127.0.0.1:{port}"]})
    assert answered == [b"tf_rdma doctor"], answered
    ps = tasks["/job:ps/replica:0/task:0"]
    assert not report["healthy"] and len(ps["problems"]) == 1, report
    assert f"at 127.0.0.1:{port + 1000} answers as {squatter}, not as /job:ps/replica:0/task:0" \
        in ps["problems"][0], ps
    assert "(a squatter)" in ps["problems"][0], ps


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="dropping CAP_IPC_LOCK needs root and setpriv (CI runs as root)")
def test_a_locked_memory_limit_too_low_for_verbs_is_a_problem(cluster):
    spec = {"ps": cluster.spec["ps"]}
    # prlimit lowers the limit; without CAP_IPC_LOCK (which lifts it for root) it binds.
    wrapper = ["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]
    _, report = doctor(spec, wrapper=wrapper, TF_RDMA_BACKEND="verbs")
    memlock = report["memlock"]
    assert memlock["applies"] and memlock["limit"] == 65536, memlock
    assert "ulimit -l is 64 KiB and verbs registers at least 1 MiB here" in memlock["problem"], memlock
    assert "IPC_LOCK capability in Kubernetes" in memlock["problem"] and not report["healthy"], memlock
