"""Programs for test_security.py: `python security_programs.py FUNCTION JSON_ARGS`, as programs.py."""
import json
import os
import sys
import time

import numpy as np


def steps_for(cluster, job, index, output, seconds):
    """TF1 worker: steps that read a ps variable, for `seconds` after the first ("warm"); records
    how many ran and the first error."""
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    server = tf_rdma.Server(cluster, job_name=job, task_index=index)
    with tf.device("/job:ps/task:0"):
        variable = tf.compat.v1.Variable(np.arange(1000, dtype=np.float32))
    with tf.device("/job:worker/task:0"):
        total = tf.reduce_sum(variable * 2.0)
    outcome = {"steps": 0, "error": None}
    with tf.compat.v1.Session(server.target) as session:
        session.run(variable.initializer)
        session.run(total)
        print("warm", flush=True)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                assert session.run(total) == 999000.0
                outcome["steps"] += 1
        except Exception as e:  # the outcome under test, whatever its class
            outcome["error"] = f"{type(e).__name__}: {e}"[:2000]
    with open(output, "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def push_and_pull(cluster, job, index, sizes):
    """TF1 worker: until killed, steps that add tensors of `sizes` float32s into this worker's own
    ps variables and read them back, so tensors cross both ways; prints "warm" after the first."""
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    server = tf_rdma.Server(cluster, job_name=job, task_index=index)
    with tf.device("/job:ps/task:0"):
        # float64: float32 sums of millions of elements stop being exact within a few hundred steps
        variables = [tf.compat.v1.Variable(tf.zeros([n], tf.float64), name=f"w{index}_{n}") for n in sizes]
    with tf.device(f"/job:{job}/task:{index}"):
        updates = [v.assign_add(tf.ones([n], tf.float64)) for v, n in zip(variables, sizes)]
        with tf.control_dependencies(updates):
            totals = [tf.reduce_sum(v.read_value()) for v in variables]
    with tf.compat.v1.Session(server.target) as session:
        session.run([v.initializer for v in variables])
        step = 0
        while True:
            step += 1
            got, want = session.run(totals), [float(step * n) for n in sizes]
            assert got == want, f"step {step}: read back {got}, expected {want}"
            if step == 3:
                print("warm", flush=True)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
