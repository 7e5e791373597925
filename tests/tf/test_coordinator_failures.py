"""tf_rdma/coordinator_failures.py: which errors TensorFlow's ClusterCoordinator, told by tf_rdma,
takes for a ps's failure and which for a worker's. The messages are those of
tests/faults/test_ps_strategy_faults.py's runs (TensorFlow 2.21), shortened."""
import pytest
import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator

from tf_rdma import coordinator_failures

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
# Stock gRPC's own failure of the ps, no tf_rdma in it.
GRPC_LOST_THE_PS = f"Socket closed\n{ROUTE.format(PS, 'RunComponentFunction')}\n{ROUTE.format(WORKER, 'Enqueue')}"


def unavailable(message):
    return tf.errors.UnavailableError(None, None, message)


@pytest.fixture
def told(monkeypatch):
    """TensorFlow's verdicts before, and the module with tf_rdma's installed (undone afterwards)."""
    before = cluster_coordinator._is_ps_failure, cluster_coordinator._is_worker_failure
    monkeypatch.setattr(cluster_coordinator, "_is_ps_failure", before[0])
    monkeypatch.setattr(cluster_coordinator, "_is_worker_failure", before[1])
    coordinator_failures.install()
    coordinator_failures.install()  # idempotent: wrapped once
    return before


@pytest.mark.parametrize("message, ps_failure, worker_failure", [
    (PS_LOST_THE_WORKER, False, True),
    (EACH_NAMED_THE_OTHER, False, True),
    (TOLD_IT_WENT_SILENT, False, True),
    (THE_PS_WENT_AWAY, True, False),
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
