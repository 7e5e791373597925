"""ClusterCoordinator's failure attribution, told whom tf_rdma found failed.

TensorFlow's coordinator tells whose failure an error is by the gRPC route the error came back on:
an error that passed through a parameter server ("GRPC error information from remote target
/job:ps...") is a transient ps failure, of which it forgives TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES
(3 per ps for the job's life) and raises the next to the user. Over gRPC with TensorFlow's settings a
ps never notices a worker that is stopped or cut off, so that route means the ps. Over tf_rdma the ps
does notice, within TF_RDMA_PEER_TIMEOUT_MS, and fails its part of the worker's step naming the
worker; that error goes back to the worker in the ps's answer and from there to the coordinator, on
the ps's route. A job could then die of a worker's freezes or partitions, where gRPC goes on.

tf_rdma's failures name the task they found failed, in the words ClusterCoordinator reads
(cc/tf/runtime TaskFailure: "(as gRPC words it, for TensorFlow's failure handling: GRPC error
information from remote target TASK)"); a task told by its peer that it was the silent one names
nobody. So an error in which tf_rdma names a worker is that worker's failure: TensorFlow retries
the step once the worker answers, as it does when its own channel to a worker fails. An error in
which tf_rdma names only a ps (the ps died, hangs or was restarted) stays a ps failure, and one
without tf_rdma's words is judged by TensorFlow alone.
"""
import logging
import re

import tensorflow as tf

log = logging.getLogger("tf_rdma")

# TaskFailure's phrase, with the task it names.
_NAMED_FAILED = re.compile(r"for TensorFlow's failure handling: GRPC error information from remote target "
                           r"/job:([A-Za-z0-9_.-]+)/replica:\d+/task:\d+\)")
_INSTALLED = "_tf_rdma_attribution"


def jobs_named_failed(error):
    """The jobs of the tasks tf_rdma's failures in `error` name as failed (a closure's error
    included: ClusterCoordinator wraps some in ClosureInputError / ClosureAbortedError)."""
    error = getattr(error, "original_exception", None) or error
    return {match.group(1) for match in _NAMED_FAILED.finditer(str(error))}


def names_a_worker(error):
    return "worker" in jobs_named_failed(error)


def install():
    """Makes TensorFlow's ClusterCoordinator (in this process) take an error in which tf_rdma names a
    worker for that worker's failure, not a ps's. Idempotent."""
    try:
        from tensorflow.python.distribute.coordinator import cluster_coordinator as coordinator
        is_ps_failure, is_worker_failure = coordinator._is_ps_failure, coordinator._is_worker_failure
    except (ImportError, AttributeError) as e:
        log.warning("tf_rdma: TensorFlow %s's ClusterCoordinator has no failure attribution to inform (%s): "
                    "a worker stopped or cut off past TF_RDMA_PEER_TIMEOUT_MS may count against "
                    "TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES", tf.__version__, e)
        return
    if getattr(is_ps_failure, _INSTALLED, False):
        return

    def _is_ps_failure(error):
        return not names_a_worker(error) and is_ps_failure(error)

    def _is_worker_failure(error):
        unavailable = isinstance(getattr(error, "original_exception", None) or error,
                                 (tf.errors.UnavailableError, tf.errors.AbortedError))
        return (unavailable and names_a_worker(error)) or is_worker_failure(error)

    for function in (_is_ps_failure, _is_worker_failure):
        setattr(function, _INSTALLED, True)
    coordinator._is_ps_failure, coordinator._is_worker_failure = _is_ps_failure, _is_worker_failure
