"""DTensor multi-client programs: `python dtensor_clients.py FUNCTION JSON_ARGS`, as tasks.py. Each
task is one DTensor client with 2 logical CPU devices of a 4-device mesh; the cluster's job is
DTensor's job, its addresses DTENSOR_JOBS."""
import json
import os
import sys
import time

import numpy as np

CPUS_PER_CLIENT = 2
BATCH, FEATURES, UNITS = 8, 256, 16384


def _start(cluster, job, index, transport):
    """DTensor's multi-client start, TensorFlow's or tf_rdma's; the 4-device mesh."""
    os.environ.update(DTENSOR_JOBS=",".join(cluster[job]), DTENSOR_CLIENT_ID=str(index),
                      DTENSOR_JOB_NAME=job)
    import tensorflow as tf
    dtensor = tf.experimental.dtensor
    if transport == "rdma":
        import tf_rdma
        start = tf_rdma.dtensor.initialize_accelerator_system
    else:
        start = dtensor.initialize_accelerator_system
    start(device_type="CPU", num_logical_cpu_devices=CPUS_PER_CLIENT)
    return dtensor.create_distributed_mesh([("batch", CPUS_PER_CLIENT * len(cluster[job]))], device_type="CPU")


def _step(mesh):
    """A step: a batch-sharded matmul (each device its rows), then sums over the batch, which
    all-reduce across the mesh, so across the clients (64 KiB and a scalar per step), and the
    product's rows gathered onto every device (512 KiB)."""
    import tensorflow as tf
    dtensor = tf.experimental.dtensor
    sharded = dtensor.Layout.batch_sharded(mesh, "batch", rank=2)
    replicated = dtensor.Layout.replicated(mesh, rank=2)

    @tf.function
    def matmul_and_sums(x, w):
        y = tf.matmul(x, w)
        # The rows on every device: an all-gather across the clients.
        everywhere = dtensor.relayout(y, dtensor.Layout.replicated(mesh, rank=2))
        return tf.reduce_sum(y, axis=0), tf.reduce_sum(y), everywhere

    def step(seed):
        # The step's inputs, the same in every run; this client packs its devices' parts.
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((BATCH, FEATURES), np.float32)
        w = rng.standard_normal((FEATURES, UNITS), np.float32)
        rows = BATCH // len(mesh.global_device_ids().flatten())
        local = mesh.local_device_ids()
        return matmul_and_sums(dtensor.pack([x[d * rows:(d + 1) * rows] for d in local], sharded),
                               dtensor.pack([w] * len(local), replicated))
    return step


def client(cluster, job, index, transport, output, steps):
    """Runs `steps` steps and saves this client's components of every result (OUTPUT, and tf_rdma's
    stats in OUTPUT.stats.json); prints "done", then keeps stepping until a step fails (the test
    kills the other client), and records the error's class and message in OUTPUT.failure.json."""
    import tensorflow as tf
    dtensor = tf.experimental.dtensor
    step = _step(_start(cluster, job, index, transport))
    results = {}
    for s in range(steps):
        column_sums, total, gathered = step(s)
        for name, value in (("column_sums", column_sums), ("total", total), ("gathered", gathered)):
            for device, component in enumerate(dtensor.unpack(value)):
                results[f"step{s}/{name}/device{device}"] = component.numpy()
    np.savez(output, **results)
    if transport == "rdma":
        import tf_rdma
        with open(output + ".stats.json", "w") as f:
            json.dump(tf_rdma.stats(), f)
    print("done", flush=True)
    outcome = {}
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            step(steps)[1].numpy()
    except Exception as e:  # the outcome under test, whatever its class
        outcome = {"error": type(e).__name__, "message": str(e), "failed_at": time.time()}
    with open(output + ".failure.json.tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(output + ".failure.json.tmp", output + ".failure.json")
    # Stay up until the test ends, as a client of a real job would be stopped.
    time.sleep(3600)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
