"""Task programs for MultiWorkerMirroredStrategy tests: `python collective.py FUNCTION
JSON_ARGS`, as tasks.py. Each worker sets its TF_CONFIG from the cluster and its index, and the
strategy starts its server (no separate server call, as with TensorFlow's strategy)."""
import json
import os
import sys
import time

import numpy as np


def _strategy(cluster, job, index, transport):
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    import tensorflow as tf
    if transport == "rdma":
        import tf_rdma
        return tf_rdma.MultiWorkerMirroredStrategy()
    return tf.distribute.MultiWorkerMirroredStrategy()


def _all_reduce_step(strategy, elements):
    """A step all-reducing a float32 vector whose values depend on the worker and the step."""
    import tensorflow as tf
    worker = tf.constant(strategy.cluster_resolver.task_id, tf.float32)

    @tf.function
    def step(step_index):
        def replica():
            values = tf.range(elements, dtype=tf.float32) * (worker + 1.0) + step_index
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, values)
        return strategy.run(replica)
    return step


def all_reduce_worker(cluster, job, index, transport, output, steps=5, elements=1 << 20):
    """Runs `steps` all-reduces and saves every result, and the seconds each step after the first
    took (the first sets up the collective group) in OUTPUT.seconds, a JSON list."""
    import tensorflow as tf
    strategy = _strategy(cluster, job, index, transport)
    step = _all_reduce_step(strategy, elements)
    results = {"step/0": step(tf.constant(0.0)).numpy()}
    seconds = []
    for s in range(1, steps):
        started = time.monotonic()
        results[f"step/{s}"] = step(tf.constant(float(s))).numpy()
        seconds.append(time.monotonic() - started)
    with open(output + ".seconds", "w") as f:
        json.dump(seconds, f)
    np.savez(output, **results)
    if transport == "rdma":
        import tf_rdma
        with open(output + ".stats.json", "w") as f:
            json.dump(tf_rdma.stats(), f)


def all_reduce_until_failure(cluster, job, index, transport, output, elements=4 << 20):
    """All-reduces until one fails (the test kills or stops a peer meanwhile); records the error's
    class and message, and when it came, then waits to be killed."""
    import tensorflow as tf
    strategy = _strategy(cluster, job, index, transport)
    step = _all_reduce_step(strategy, elements)
    step(tf.constant(0.0)).numpy()
    print("warm", flush=True)
    outcome = {}
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            step(tf.constant(1.0)).numpy()
    except Exception as e:  # the outcome under test, whatever its class
        outcome = {"error": type(e).__name__, "message": str(e), "failed_at": time.time()}
    with open(output + ".tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(output + ".tmp", output)
    # Stay up until the test ends: a worker that exits here would fail the others' collectives
    # with its own departure before they saw the loss under test.
    time.sleep(3600)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
