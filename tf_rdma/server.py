"""tf_rdma.Server: a drop-in for tf.distribute.Server whose cross-task tensors travel over tf_rdma.

Start one in every process of the cluster, as you would tf.distribute.Server. Graphs that sessions
(TF1) or workers (TF2 ParameterServerStrategy) register afterwards get their cross-task transfers
rewritten to tf_rdma's kernels.
"""
import json
import logging
import os

import tensorflow as tf

from tf_rdma.config import load_config
from tf_rdma.errors import ConfigError

log = logging.getLogger("tf_rdma")

# Jobs whose tasks are clients (they build and drive graphs, but run no tf_rdma listener):
# transfers to and from them stay on gRPC. The same rule holds in every process, so both ends of an
# edge always agree.
CLIENT_JOBS = ("chief", "evaluator")


def _task_name(job, index):
    return f"/job:{job}/replica:0/task:{index}"


def _split_address(address, task):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"task {task} has address {address!r}, not host:port")
    return host.strip("[]"), int(port)


def cluster_tasks(cluster_spec, rdma_addresses=None, port_offset=None):
    """[(task, host, grpc_port, rdma_port)] of the tasks that run tf_rdma, in a fixed order."""
    offset = load_config().port_offset if port_offset is None else port_offset
    overrides = dict(rdma_addresses or {})
    tasks = []
    for job in sorted(cluster_spec.jobs):
        if job in CLIENT_JOBS:
            continue
        for index in cluster_spec.task_indices(job):
            task = _task_name(job, index)
            host, grpc_port = _split_address(cluster_spec.task_address(job, index), task)
            if task in overrides:
                rdma_host, rdma_port = _split_address(overrides.pop(task), task)
                if rdma_host != host:
                    raise ConfigError(f"rdma_addresses[{task!r}] must use the task's host {host}")
            else:
                rdma_port = grpc_port + offset
            if not 0 < rdma_port < 65536:
                raise ConfigError(f"task {task}: port {grpc_port} + TF_RDMA_PORT_OFFSET {offset} is "
                                  f"{rdma_port}, not a port; choose another TF_RDMA_PORT_OFFSET")
            tasks.append((task, host, grpc_port, rdma_port))
    if overrides:
        raise ConfigError(f"rdma_addresses names tasks not in the cluster: {sorted(overrides)}")
    return tasks


def cluster_key(tasks):
    """Derived from the whole cluster, so a process of another cluster cannot connect."""
    description = ";".join(f"{t}={h}:{g}:{r}" for t, h, g, r in tasks)
    return load_config().cluster_key(description)


def start_runtime(cluster_spec, local_task, rdma_addresses=None):
    """Loads the kernels and graph pass into this process and starts its tf_rdma runtime."""
    from tf_rdma import _tensorflow  # registers the kernels and the graph pass with TensorFlow
    tasks = cluster_tasks(cluster_spec, rdma_addresses)
    _tensorflow.start_runtime(local_task, tasks, cluster_key(tasks))
    log.info("tf_rdma: runtime started as %s for %d tasks", local_task or "a client", len(tasks))


class Server(tf.distribute.Server):
    """tf.distribute.Server, with every cross-task tensor of this task carried by tf_rdma.

    Takes tf.distribute.Server's arguments, plus `rdma_addresses`: {task name: "host:port"} for
    tasks whose tf_rdma listener is not at their server port + TF_RDMA_PORT_OFFSET (give the same
    mapping to every task).
    """

    def __init__(self, server_or_cluster_def, job_name=None, task_index=None, protocol=None,
                 config=None, start=True, rdma_addresses=None):
        if isinstance(server_or_cluster_def, tf.train.ServerDef):
            cluster_spec = tf.train.ClusterSpec(server_or_cluster_def.cluster)
            job_name = job_name or server_or_cluster_def.job_name
            task_index = server_or_cluster_def.task_index if task_index is None else task_index
        else:
            cluster_spec = tf.train.ClusterSpec(server_or_cluster_def)
        if job_name is None:
            if len(cluster_spec.jobs) != 1:
                raise ConfigError("job_name is required when the cluster has several jobs")
            job_name = cluster_spec.jobs[0]
        if task_index is None:
            indices = cluster_spec.task_indices(job_name)
            if len(indices) != 1:
                raise ConfigError(f"task_index is required: job {job_name!r} has several tasks")
            task_index = indices[0]
        local_task = "" if job_name in CLIENT_JOBS else _task_name(job_name, task_index)
        # tf_rdma listens before TensorFlow serves, so a peer that reaches this task's TensorFlow
        # server also finds its tf_rdma listener.
        start_runtime(cluster_spec, local_task, rdma_addresses)
        super().__init__(server_or_cluster_def, job_name=job_name, task_index=task_index,
                         protocol=protocol, config=config, start=start)

    @classmethod
    def from_tf_config(cls, tf_config=None, **kwargs):
        """A Server for the task TF_CONFIG (the ecosystem's standard JSON) describes."""
        text = os.environ.get("TF_CONFIG") if tf_config is None else tf_config
        if not text:
            raise ConfigError("TF_CONFIG is not set; set it to {\"cluster\": {...}, \"task\": "
                              "{\"type\": ..., \"index\": ...}}")
        try:
            parsed = json.loads(text) if isinstance(text, str) else dict(text)
            cluster, task = parsed["cluster"], parsed["task"]
            return cls(tf.train.ClusterSpec(cluster), job_name=task["type"],
                       task_index=int(task["index"]), **kwargs)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"TF_CONFIG is not a valid cluster description: {e}") from e


def enable_in_client(cluster_spec, rdma_addresses=None):
    """For a process that drives the cluster without serving (a TF2 client or coordinator): its
    graphs get rewritten too, where it partitions them."""
    start_runtime(tf.train.ClusterSpec(cluster_spec), "", rdma_addresses)


def stats():
    """What tf_rdma carried in this process: rewritten and fallback edges (with reasons), and per
    peer task its backend, tensors, bytes, grants and errors. Empty before a Server started."""
    from tf_rdma import _tensorflow
    return _tensorflow.stats()


def reset_stats():
    from tf_rdma import _tensorflow
    _tensorflow.reset_stats()


def ParameterServerStrategy(cluster_resolver, *args, **kwargs):
    """tf.distribute.experimental.ParameterServerStrategy whose ps<->worker tensors go over tf_rdma.

    The ps and worker tasks must run tf_rdma.Server; this process (the coordinator) only drives
    them. Takes the same arguments as TensorFlow's strategy.
    """
    enable_in_client(cluster_resolver.cluster_spec())
    return tf.distribute.experimental.ParameterServerStrategy(cluster_resolver, *args, **kwargs)
