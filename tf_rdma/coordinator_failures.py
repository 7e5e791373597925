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
the step once the worker answers, as it does when its own channel to a worker fails.

An error in which tf_rdma names only a ps is not always the ps's. A worker cut off from the rest
finds the ps silent as the ps finds it, and its own failure may be the one that reaches the
coordinator (after the partition heals): "peer /job:ps/... is unresponsive". From one end of a
silent link nobody can tell which end went away; the coordinator can. It asks each task named as
silent to prove itself (tf_rdma's handshake, within TF_RDMA_PEER_TIMEOUT_MS: a stopped process, or
one cut off from the coordinator too, cannot complete it). If all do, the failure is the worker's.
Otherwise (the ps died, hangs, was restarted or is cut off from everyone) it stays a ps failure,
and an error without tf_rdma's words is judged by TensorFlow alone.
"""
import collections
import logging
import re
import threading

import tensorflow as tf

from tf_rdma import _transport
from tf_rdma.config import load_config
from tf_rdma.errors import TransportError

log = logging.getLogger("tf_rdma")

_TASK = r"/job:[A-Za-z0-9_.-]+/replica:\d+/task:\d+"
# TaskFailure's phrase, before the task it names.
_PHRASE = r"\(as gRPC words it, for TensorFlow's failure handling: GRPC error information from remote target "
_NAMED_FAILED = re.compile(_PHRASE + f"({_TASK})" + r"\)")
# The phrase after PeerFailure's cause for a peer that sent nothing for TF_RDMA_PEER_TIMEOUT_MS
# (cc/transport/peer_errors.cc), naming the same task.
_FOUND_SILENT = re.compile(f"peer ({_TASK}) at \\S+ is unresponsive: [^\\n]*? " + _PHRASE + r"\1\)")
# The name the coordinator's probe gives itself in the handshake: not a task name, so the task
# probed proves its name and key and then refuses the connection, adopting nothing (a task name
# sorting before the task's would replace the connection of the task that bears it).
PROBE_NAME = "tf_rdma coordinator probe"
_INSTALLED = "_tf_rdma_attribution"
_VERDICT = "_tf_rdma_workers_failure"


class TaskProbe:
    """Asks tasks of the coordinator's cluster, over tcp (every task listens there, whatever its
    backend), to prove who they are."""

    def __init__(self):
        self._lock = threading.Lock()
        self._addresses = {}  # task: "host:port" of its tf_rdma listener

    def know(self, tasks):
        """`tasks`: [(task, host, grpc_port, rdma_port)] as server.cluster_tasks gives them."""
        with self._lock:
            self._addresses.update({task: f"{host}:{rdma_port}" for task, host, _, rdma_port in tasks})

    def answers(self, task):
        """Whether `task` completes tf_rdma's handshake as itself within TF_RDMA_PEER_TIMEOUT_MS;
        None if its address is not known here."""
        with self._lock:
            address = self._addresses.get(task)
        if address is None:
            return None
        config = load_config()
        # A transport of its own, gone with the probe: probes are rare (a failure each), and a
        # coordinator that kept one would keep its threads and descriptors for the job's life.
        transport = _transport.Transport("tcp", name=PROBE_NAME, cluster_key=config.cluster_key(),
                                          connect_timeout=config.peer_timeout, peer_timeout=config.peer_timeout)
        try:
            connection = transport.connect(address)
        except TransportError as e:
            log.info("tf_rdma: task %s does not answer the coordinator at %s: %s", task, address, e)
            return False
        name = connection.peer_name
        connection.close("tf_rdma: the coordinator's probe is done")
        if name != task:
            log.warning("tf_rdma: %s answers for task %s as %s", address, task, name)
        return name == task


_prober = TaskProbe()


def task_answers(task):
    """Whether `task` of the cluster install() was told of proves itself to this process within
    TF_RDMA_PEER_TIMEOUT_MS (None: not told of it)."""
    return _prober.answers(task)


def tasks_named_failed(error):
    """{task: found silent?} for the tasks tf_rdma's failures in `error` name as failed (a
    closure's error included: ClusterCoordinator wraps some in ClosureInputError /
    ClosureAbortedError). A task named by more than one failure counts as silent only if every one
    found it so."""
    text = str(getattr(error, "original_exception", None) or error)
    named = collections.Counter(match.group(1) for match in _NAMED_FAILED.finditer(text))
    silent = collections.Counter(match.group(1) for match in _FOUND_SILENT.finditer(text))
    return {task: silent[task] == count for task, count in named.items()}


def jobs_named_failed(error):
    return {task.split("/")[1][len("job:"):] for task in tasks_named_failed(error)}


def workers_failure(error, answers=None):
    """Whether `error` is, by tf_rdma's account, the failure of the worker that ran the step: it
    names a worker failed, or only tasks it found silent that answer here. `answers(task)`: the
    probe (the coordinator's by default). False leaves the error to TensorFlow's judgement."""
    named = tasks_named_failed(error)
    if not named:
        return False
    if "worker" in jobs_named_failed(error):
        return True
    answers = answers or _prober.answers
    # Silent to the worker but answering here: the worker was the one cut off (or its link alone).
    return all(named.values()) and all(answers(task) for task in named)


def _judged(error):
    """workers_failure(error), probed once per error: TensorFlow asks both questions of one error."""
    verdict = getattr(error, _VERDICT, None)
    if verdict is None:
        verdict = workers_failure(error)
        try:
            setattr(error, _VERDICT, verdict)
        except AttributeError:
            pass
    return verdict


def install(tasks=()):
    """Makes TensorFlow's ClusterCoordinator (in this process) take an error in which tf_rdma names a
    worker, or tasks that answer this process, for the failure of the worker that ran the step,
    not a ps's. `tasks`: the cluster's, as server.cluster_tasks gives them, for the probe.
    Idempotent."""
    _prober.know(tasks)
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
        return not _judged(error) and is_ps_failure(error)

    def _is_worker_failure(error):
        unavailable = isinstance(getattr(error, "original_exception", None) or error,
                                 (tf.errors.UnavailableError, tf.errors.AbortedError))
        return (unavailable and _judged(error)) or is_worker_failure(error)

    for function in (_is_ps_failure, _is_worker_failure):
        setattr(function, _INSTALLED, True)
    coordinator._is_ps_failure, coordinator._is_worker_failure = _is_ps_failure, _is_worker_failure
