"""One-line drop-ins for TensorFlow's distributed entry points, on tf_rdma's server protocol.

Every one of them runs TensorFlow's own server with the protocol "grpc+tf_rdma" (registered when
tf_rdma's extension loads): gRPC keeps the master and worker control calls, and every tensor and
collective buffer that crosses between tasks' CPU devices moves over tf_rdma. Use them in every
process of the cluster.
"""
import json
import logging
import os

import tensorflow as tf

from tf_rdma import coordinator_failures
from tf_rdma.errors import ConfigError, TensorFlowMismatchError

log = logging.getLogger("tf_rdma")


def _check_built_against_this_tensorflow():
    # TensorFlow's internal classes, which tf_rdma's server subclasses, change layout between
    # releases: loading a build made for another TensorFlow could crash, so it is refused first.
    from tf_rdma import _transport  # built in the same run as _tensorflow, without TensorFlow
    if tf.__version__ != _transport.BUILT_WITH_TENSORFLOW:
        raise TensorFlowMismatchError(
            f"tf_rdma was built against TensorFlow {_transport.BUILT_WITH_TENSORFLOW}, and this process runs "
            f"TensorFlow {tf.__version__}: rebuild tf_rdma against it (`pip install --no-build-isolation "
            "--force-reinstall --no-deps /path/to/tf_rdma` in this environment)")


_check_built_against_this_tensorflow()

# Eager copies from a client to a remote task ride inside gRPC's Enqueue call unless this is "0";
# with "0" they go through the rendezvous, which tf_rdma carries. Read when a client connects.
_SEND_TENSOR_RPC = "TF_EAGER_REMOTE_USE_SEND_TENSOR_RPC"


def _extension():
    from tf_rdma import _tensorflow  # registers the server protocol with TensorFlow
    return _tensorflow


def protocol():
    """The server protocol name to give TensorFlow (`protocol=` or a cluster resolver's rpc_layer)."""
    return _extension().PROTOCOL


def receive_pool_slab_bytes():
    """(least, most) bytes a receive pool grows by per peer (RuntimeOptions), what verbs registers."""
    return _extension().RECEIVE_POOL_SLAB_BYTES


def _checked_protocol(requested):
    ours = protocol()
    if requested not in (None, "grpc", ours):
        raise ConfigError(f"protocol={requested!r}: tf_rdma runs its own protocol {ours!r} (gRPC for "
                          "control calls, tf_rdma for tensors); leave protocol unset")
    return ours


def _route_eager_copies_through_rendezvous():
    if os.environ.get(_SEND_TENSOR_RPC, "0") != "0":
        log.warning("tf_rdma: %s=%s keeps eager copies to remote tasks on gRPC; unset it to carry "
                    "them over tf_rdma", _SEND_TENSOR_RPC, os.environ[_SEND_TENSOR_RPC])
        return
    os.environ[_SEND_TENSOR_RPC] = "0"


# The rdma_addresses this process's servers were given last (its extension holds the same).
_address_overrides = {}


def _set_address_overrides(rdma_addresses):
    global _address_overrides
    _address_overrides = dict(rdma_addresses or {})
    _extension().set_address_overrides(_address_overrides)


def cluster_tasks(cluster_spec, rdma_addresses=None):
    """[(task, host, grpc_port, rdma_port)] of every task, as tf_rdma's servers derive them: the
    TensorFlow port + TF_RDMA_PORT_OFFSET, unless `rdma_addresses` says otherwise."""
    cluster_spec = tf.train.ClusterSpec(cluster_spec)
    overrides = dict(rdma_addresses or {})
    names = {f"/job:{job}/replica:0/task:{index}" for job in cluster_spec.jobs
             for index in cluster_spec.task_indices(job)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"rdma_addresses names tasks not in the cluster: {unknown}")
    return _extension().tasks_of(cluster_spec.as_cluster_def().SerializeToString(), overrides)


class Server(tf.distribute.Server):
    """tf.distribute.Server on tf_rdma's protocol: every cross-task tensor of this task (TF1 sessions,
    TF2 functions and eager copies, collectives) moves over tf_rdma.

    Takes tf.distribute.Server's arguments, plus `rdma_addresses`: {task name: "host:port"} for
    tasks whose tf_rdma listener is not at their server port + TF_RDMA_PORT_OFFSET (give the same
    mapping to every task).
    """

    def __init__(self, server_or_cluster_def, job_name=None, task_index=None, protocol=None,
                 config=None, start=True, rdma_addresses=None):
        if rdma_addresses:
            cluster = (server_or_cluster_def.cluster
                       if isinstance(server_or_cluster_def, tf.train.ServerDef) else server_or_cluster_def)
            cluster_tasks(cluster, rdma_addresses)  # checks them, with a clear error
        _set_address_overrides(rdma_addresses)
        super().__init__(server_or_cluster_def, job_name=job_name, task_index=task_index,
                         protocol=_checked_protocol(protocol), config=config, start=start)

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
            job, index = task["type"], int(task["index"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"TF_CONFIG is not a valid cluster description: {e}") from e
        return cls(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, **kwargs)


def _on_tf_rdma(cluster_resolver):
    cluster_resolver.rpc_layer = protocol()
    return cluster_resolver


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """tf.distribute.MultiWorkerMirroredStrategy whose collectives move over tf_rdma.

    Same arguments; reads TF_CONFIG like TensorFlow's when no cluster resolver is given, and starts
    this task's server itself (no tf_rdma.Server needed).
    """

    def __init__(self, cluster_resolver=None, communication_options=None):
        if cluster_resolver is None:
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        super().__init__(cluster_resolver=_on_tf_rdma(cluster_resolver),
                         communication_options=communication_options)


class ParameterServerStrategy(tf.distribute.experimental.ParameterServerStrategy):
    """tf.distribute.experimental.ParameterServerStrategy over tf_rdma, the coordinator included:
    its own transfers (variable creation, reads, evaluation) move over tf_rdma too.

    The ps and worker tasks run tf_rdma.Server; this process is the coordinator. Same arguments as
    TensorFlow's strategy. Its ClusterCoordinator takes an error in which tf_rdma names a worker as
    failed, or only tasks that answer the coordinator, for the failure of the worker that ran the
    step, not a ps's (tf_rdma/coordinator_failures.py).
    """

    def __init__(self, cluster_resolver, variable_partitioner=None):
        _route_eager_copies_through_rendezvous()
        coordinator_failures.install(cluster_tasks(cluster_resolver.cluster_spec(), _address_overrides))
        super().__init__(_on_tf_rdma(cluster_resolver), variable_partitioner=variable_partitioner)


def connect_to_cluster(cluster_spec_or_resolver, job_name="localhost", task_index=0, protocol=None,
                       make_master_device_default=True, cluster_device_filters=None):
    """tf.config.experimental_connect_to_cluster on tf_rdma's protocol: eager copies between this
    client and the cluster's tasks, both ways, move over tf_rdma. The tasks run tf_rdma.Server."""
    _route_eager_copies_through_rendezvous()
    tf.config.experimental_connect_to_cluster(
        cluster_spec_or_resolver, job_name=job_name, task_index=task_index,
        protocol=_checked_protocol(protocol), make_master_device_default=make_master_device_default,
        cluster_device_filters=cluster_device_filters)


def data_transfer_protocol():
    """The tf.data service data transfer protocol name, registered with TensorFlow once this returns:
    give it as `data_transfer_protocol=` to WorkerConfig and to distribute()/from_dataset_id()."""
    extension = _extension()
    name = extension.DATA_TRANSFER_PROTOCOL
    if name is None:
        raise ConfigError(
            f"tf_rdma's tf.data service protocol is built for TensorFlow {extension.DATA_SERVICE_TENSORFLOW} "
            f"only (it declares TensorFlow internals the wheel ships no headers for), and this tf_rdma was "
            f"built against TensorFlow {tf.__version__}: leave data_transfer_protocol unset (gRPC), or use "
            f"TensorFlow {extension.DATA_SERVICE_TENSORFLOW}")
    return name


def stats():
    """What tf_rdma carried in this process, per server (task): per peer task its backend, tensors
    and bytes each way (also by kind: graph, eager, collective), grants, regrants and errors, the
    fused messages each way (small tensors of a step sharing one message), and the transfers left on
    gRPC with the reason. With one server in the process, its record; with
    several, {"servers": [record, ...]}; empty before any server started."""
    servers = stats_records()
    if len(servers) == 1:
        return servers[0]
    return {"servers": servers} if servers else {}


def stats_records():
    """stats() as a list of every server's record, however many there are."""
    servers = _extension().server_stats()
    # A trainer whose tf.data workers lack tf_rdma never builds a tf_rdma client: TensorFlow falls
    # back to gRPC and counts why, and that count is reported with the process's trainer record.
    data_fallbacks = _extension().data_transfer_fallbacks()
    if data_fallbacks:
        trainer = next((s for s in servers if s["task"].startswith("tf.data trainer")), None)
        if trainer is None:
            trainer = {"task": "tf.data trainer", "fallback": {}, "peers": {}}
            servers.append(trainer)
        for reason, count in data_fallbacks.items():
            trainer["fallback"][reason] = trainer["fallback"].get(reason, 0) + count
    return servers


def reset_stats():
    _extension().reset_stats()
