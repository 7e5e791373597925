"""DTensor's multi-client start on tf_rdma's server protocol.

`tf.experimental.dtensor.initialize_accelerator_system()` starts a multi-client cluster (when
`DTENSOR_JOBS` is set) on the protocol TensorFlow's platform layer names, gRPC, and offers no
argument to change it. This module starts the same cluster, from the same `DTENSOR_*` variables and
with the same ServerDef and collective settings, on "grpc+tf_rdma", through the context calls
TensorFlow's own start makes: every collective DTensor runs across clients (its all-reduces,
all-gathers between CPU devices) then moves over tf_rdma. Everything else (meshes,
layouts, `tf.experimental.dtensor.*`) is TensorFlow's, unchanged.
"""
import tensorflow as tf
from tensorflow.dtensor.python import accelerator_util
from tensorflow.python.eager import context

from tf_rdma import server
from tf_rdma.errors import ConfigError


def initialize_accelerator_system(device_type=None, enable_coordination_service=True,
                                  num_logical_cpu_devices=None, experimental_reset_context=False,
                                  experimental_enable_megcore=False):
    """tf.experimental.dtensor.initialize_accelerator_system, with a multi-client cluster on
    tf_rdma's protocol. Same arguments, same `DTENSOR_*` variables, same return value (the device
    type); call it in every client, before TensorFlow is initialized.

    Without `DTENSOR_JOBS` (one local client, no server, nothing crossing tasks) it is TensorFlow's
    own call. In multi-client mode the mesh's devices must be CPUs: tf_rdma carries tensors between
    CPU devices, and GPU and TPU collectives cross by NCCL, ICI or gRPC whatever the server is.
    """
    dtensor = tf.experimental.dtensor
    if not dtensor.jobs():
        return dtensor.initialize_accelerator_system(
            device_type=device_type, enable_coordination_service=enable_coordination_service,
            num_logical_cpu_devices=num_logical_cpu_devices,
            experimental_reset_context=experimental_reset_context,
            experimental_enable_megcore=experimental_enable_megcore)
    device_type = (device_type or dtensor.preferred_device_type()).upper()
    if device_type != "CPU":
        raise ConfigError(
            f"device_type {device_type!r}: tf_rdma carries DTensor's collectives between CPU devices "
            "only; give device_type='CPU', or start a GPU or TPU mesh with "
            "tf.experimental.dtensor.initialize_accelerator_system()")
    if accelerator_util.is_initialized():
        raise ConfigError("The accelerator system has already been initialized; a multi-client "
                         "DTensor system cannot be shut down and started again in one process")
    ctx = context.context()
    if experimental_reset_context:
        ctx.ensure_uninitialized()
    if ctx._initialized:  # pylint: disable=protected-access  (TensorFlow's own start checks it so)
        raise ConfigError("TensorFlow has already been initialized: call "
                          "tf_rdma.dtensor.initialize_accelerator_system() before any TensorFlow "
                          "operation, or pass experimental_reset_context=True")
    ctx._clear_caches()  # pylint: disable=protected-access  (as TensorFlow's own start, every time)
    if num_logical_cpu_devices is not None:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * num_logical_cpu_devices)
    _start_multi_client_cluster(ctx, dtensor.job_name(), dtensor.jobs(), dtensor.client_id(),
                                "/job:" + dtensor.full_job_name(task_id=0), enable_coordination_service)
    # DTensor's meshes refuse to be made before this is set (mesh_util.create_distributed_mesh).
    accelerator_util.set_initialized(device_type)
    return device_type


# TensorFlow exports DTensor's start under this name too.
initialize_multi_client = initialize_accelerator_system


def _start_multi_client_cluster(ctx, job_name, client_addresses, client_id, collective_leader,
                                enable_coordination_service):
    """What DTensor's multi-client start configures, with tf_rdma's protocol in the ServerDef."""
    ctx.configure_collective_ops(collective_leader=collective_leader)
    if enable_coordination_service:
        # Every client learns the others' devices through it before a collective runs.
        ctx.configure_coordination_service(service_type="standalone", service_leader=collective_leader)
    server_def = tf.train.ServerDef(
        cluster=tf.train.ClusterSpec({job_name: client_addresses}).as_cluster_def(),
        default_session_config=ctx.config, job_name=job_name, task_index=client_id,
        protocol=server.protocol())
    # DTensor's settings for the gRPC channels that still carry the control calls, and for a
    # collective buffer that falls back to gRPC (one piece instead of chunks).
    server_def.default_session_config.rpc_options.num_channels_per_target = 4
    server_def.default_session_config.experimental.recv_buf_max_chunk = -1
    ctx.enable_collective_ops(server_def)
    context.ensure_initialized()
