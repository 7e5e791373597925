"""tf_rdma/coordinator_failures.py: which errors TensorFlow's ClusterCoordinator, told by tf_rdma,
takes for a ps's failure and which for a worker's, and the probe that asks a task named as silent
whether it answers the coordinator. The messages are those of
tests/faults/test_ps_strategy_faults.py's runs (TensorFlow 2.21), shortened."""
import os
import socket
import time

import pytest
import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator

from tf_rdma import _transport, coordinator_failures
from tf_rdma.config import load_config

MARK = "(as gRPC words it, for TensorFlow's failure handling: GRPC error information from remote target {})"
WORKER, PS = "/job:worker/replica:0/task:0", "/job:ps/replica:0/task:0"
ROUTE = "Additional GRPC error information from remote target {} while calling /tensorflow.eager.EagerService/{}:"

# Worker 0 was stopped past the peer timeout: the ps failed its part of the step naming the worker,
# and the worker, running again, passed that on, on the ps's route.
PS_LOST_THE_WORKER = (
    f"Graph execution error:\ntf_rdma: receiving 'edge_47_mul' from task {WORKER} failed: peer {WORKER} at "
    f"10.213.0.3:23038 is unresponsive: the peer sent nothing for 2002 ms {MARK.format(WORKER)}\n"
    f"{ROUTE.format(PS + '/device:CPU:0', 'RunComponentFunction')}\n{ROUTE.format(WORKER, 'Enqueue')}")
# The worker's own part, told by the ps that it was the silent one: it names nobody.
TOLD_IT_WENT_SILENT = (
    f"Graph execution error:\ntf_rdma: receiving 'edge_13_Tanh/ReadVariableOp' from task {PS} failed: peer {PS} "
    f"at 10.213.0.2:39324 closed the connection because it heard nothing from this process for 2002 ms\n"
    f"{ROUTE.format(WORKER, 'Enqueue')}")
# The ps was restarted under a worker's step.
THE_PS_WENT_AWAY = (
    f"Graph execution error:\ntf_rdma: receiving 'edge_13_Tanh/ReadVariableOp' from task {PS} failed: lost "
    f"connection to peer {PS} at 10.213.0.2:53042: the peer closed the connection {MARK.format(PS)}\n"
    f"{ROUTE.format(WORKER, 'Enqueue')}")
# Cut off from each other: each side named the other.
EACH_NAMED_THE_OTHER = f"{THE_PS_WENT_AWAY}\n{PS_LOST_THE_WORKER}"
# Worker 0 was cut off from the ps and the coordinator: its own send found the ps silent, and that
# failure reached the coordinator after the heal. The ps may have been the one gone (frozen, cut off
# from everyone): the coordinator asks it.
WORKER_FOUND_THE_PS_SILENT = (
    f"Graph execution error:\ntf_rdma: sending 'edge_12_one_hot' to task {PS} failed: peer {PS} at "
    f"10.213.0.2:39324 is unresponsive: the peer sent nothing for 2001 ms (TF_RDMA_PEER_TIMEOUT_MS). It died, "
    f"hangs, or the network is down. {MARK.format(PS)}\n{ROUTE.format(WORKER, 'Enqueue')}")
# Stock gRPC's own failure of the ps, no tf_rdma in it.
GRPC_LOST_THE_PS = f"Socket closed\n{ROUTE.format(PS, 'RunComponentFunction')}\n{ROUTE.format(WORKER, 'Enqueue')}"


def unavailable(message):
    return tf.errors.UnavailableError(None, None, message)


@pytest.fixture
def told(monkeypatch):
    """TensorFlow's verdicts before, and the module with tf_rdma's installed (undone afterwards).
    Its probe is told no task's address: a task named as silent is not known to answer."""
    before = cluster_coordinator._is_ps_failure, cluster_coordinator._is_worker_failure
    monkeypatch.setattr(cluster_coordinator, "_is_ps_failure", before[0])
    monkeypatch.setattr(cluster_coordinator, "_is_worker_failure", before[1])
    monkeypatch.setattr(coordinator_failures, "_prober", coordinator_failures.TaskProbe())
    coordinator_failures.install()
    coordinator_failures.install()  # idempotent: wrapped once
    return before


@pytest.mark.parametrize("message, ps_failure, worker_failure", [
    (PS_LOST_THE_WORKER, False, True),
    (EACH_NAMED_THE_OTHER, False, True),
    (TOLD_IT_WENT_SILENT, False, True),
    (THE_PS_WENT_AWAY, True, False),
    (WORKER_FOUND_THE_PS_SILENT, True, False),
    (GRPC_LOST_THE_PS, True, False),
])
def test_an_error_is_the_failure_of_the_task_tf_rdma_names(told, message, ps_failure, worker_failure):
    error = unavailable(message)
    assert cluster_coordinator._is_ps_failure(error) is ps_failure
    assert cluster_coordinator._is_worker_failure(error) is worker_failure
    # A closure's error is judged by the error it wraps.
    wrapped = cluster_coordinator.ClosureAbortedError(error)
    assert cluster_coordinator._is_ps_failure(wrapped) is ps_failure


def test_tensorflow_alone_takes_a_stopped_worker_for_a_failed_ps(told):
    """What the module changes: TensorFlow's own verdict on the same errors."""
    is_ps_failure, is_worker_failure = told
    for message in (PS_LOST_THE_WORKER, EACH_NAMED_THE_OTHER):
        assert is_ps_failure(unavailable(message)) and not is_worker_failure(unavailable(message))


def test_other_errors_stay_tensorflows_to_judge(told):
    """Not unavailable (a user's error that mentions a worker), or nothing of tf_rdma's in it."""
    invalid = tf.errors.InvalidArgumentError(None, None, PS_LOST_THE_WORKER)
    assert not cluster_coordinator._is_worker_failure(invalid)
    assert not cluster_coordinator._is_ps_failure(invalid)
    assert coordinator_failures.jobs_named_failed(unavailable(GRPC_LOST_THE_PS)) == set()
    assert coordinator_failures.jobs_named_failed(unavailable(EACH_NAMED_THE_OTHER)) == {"ps", "worker"}
    assert coordinator_failures.tasks_named_failed(unavailable(WORKER_FOUND_THE_PS_SILENT)) == {PS: True}
    # Found silent by one failure and lost otherwise by another: not silence alone.
    both = unavailable(f"{WORKER_FOUND_THE_PS_SILENT}\n{THE_PS_WENT_AWAY}")
    assert coordinator_failures.tasks_named_failed(both) == {PS: False}
    assert not coordinator_failures.workers_failure(both, answers=lambda task: True)


def test_a_ps_found_silent_by_the_worker_that_answers_the_coordinator_is_the_workers_failure(told):
    """The worker was the one cut off: the step is retried once it answers, no ps failure counted.
    Probed once per error, however many times TensorFlow asks."""
    probed = []

    def answers(task):
        probed.append(task)
        return True

    error = unavailable(WORKER_FOUND_THE_PS_SILENT)
    assert coordinator_failures.workers_failure(error, answers=answers) and probed == [PS]
    coordinator_failures._prober.know([(PS, "127.0.0.1", 0, 1)])  # nothing listens there
    assert not coordinator_failures.workers_failure(error)
    with_probe = unavailable(WORKER_FOUND_THE_PS_SILENT)
    coordinator_failures._prober.answers = answers
    assert not cluster_coordinator._is_ps_failure(with_probe)
    assert cluster_coordinator._is_worker_failure(with_probe)
    assert probed == [PS, PS]


@pytest.fixture
def probe(monkeypatch):
    """A TaskProbe holding this process's key, its wait for an answer 0.5 s."""
    monkeypatch.setenv("TF_RDMA_PEER_TIMEOUT_MS", "500")
    return coordinator_failures.TaskProbe()


def listener(name):
    transport = _transport.Transport("tcp", name=name, cluster_key=load_config().cluster_key())
    return transport, transport.listen("127.0.0.1:0")


def test_the_probe_takes_only_the_task_itself_completing_the_handshake_for_an_answer(probe):
    """The task answers; another task at its address (a restarted cluster's), nothing listening
    (it died), or a process that takes the connection and never answers (stopped: its kernel
    accepts for it) do not, each within the peer timeout. A task whose address the coordinator was
    not told is not judged."""
    ps_transport, ps = listener(PS)
    other_transport, other = listener("/job:ps/replica:0/task:1")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    tasks = {PS: ps.port, "/job:ps/replica:0/task:2": other.port, "/job:ps/replica:0/task:3": closed_port,
             "/job:ps/replica:0/task:4": silent.getsockname()[1]}
    probe.know([(task, "127.0.0.1", 0, port) for task, port in tasks.items()])
    answered = {}
    for task in tasks:
        started = time.monotonic()
        answered[task] = probe.answers(task), time.monotonic() - started
    assert answered[PS][0] is True and answered[PS][1] < 0.5, answered
    for task in list(tasks)[1:]:
        assert answered[task][0] is False and answered[task][1] < 0.5 + 0.5, (task, answered)
    assert probe.answers(WORKER) is None
    silent.close()


def test_probes_leave_no_thread_or_descriptor_behind(probe):
    """The coordinator probes on failures for the job's life: each probe's transport goes with it."""
    ps_transport, ps = listener(PS)
    probe.know([(PS, "127.0.0.1", 0, ps.port)])

    def held():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    before = held()
    for _ in range(20):
        assert probe.answers(PS)
    # The ps listens in this process too: its end of the last probe's connection closes on its own
    # threads a moment after the probe's end does. A leak stays; that does not.
    deadline = time.monotonic() + 5
    while held() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() == before
