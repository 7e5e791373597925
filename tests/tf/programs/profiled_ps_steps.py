"""TF1 parameter-server steps (a ps and a worker, tf_rdma servers in this process) with TensorFlow's
profiler on for STEPS of them: writes tf_rdma's events in the profile (trace_events.py) and the
step count to OUTPUT as JSON.

    python -m tests.tf.programs.profiled_ps_steps LOG_DIR OUTPUT
"""
import json
import sys

from tests.tf.programs.cluster import free_ports
from tests.tf.programs.trace_events import tf_rdma_events

STEPS = 5
ROWS, COLUMNS = 256, 100  # the ps variable: 102,400 bytes to the worker and its gradient back


def main(log_dir, output):
    import tensorflow as tf
    import tf_rdma
    ports = free_ports(2)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    servers = [tf_rdma.Server(cluster, job_name=job, task_index=0) for job in ("ps", "worker")]
    tf.compat.v1.disable_eager_execution()
    with tf.device("/job:ps/task:0"):
        weights = tf.Variable(tf.ones([ROWS, COLUMNS]) * 0.01)
    with tf.device("/job:worker/task:0"):
        features = tf.random.stateless_normal([8, ROWS], seed=[1, 2])
        loss = tf.reduce_sum(tf.square(tf.matmul(features, weights)))
        gradient = tf.gradients(loss, weights)[0]  # depends on the weights: computed each step
    with tf.device("/job:ps/task:0"):
        train = weights.assign_sub(1e-4 * gradient)
    with tf.compat.v1.Session(servers[1].target) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        session.run([train, loss])  # the first step plans and connects
        tf.profiler.experimental.start(log_dir)
        for _ in range(STEPS):
            session.run([train, loss])
        tf.profiler.experimental.stop()
    with open(output, "w") as f:
        json.dump({"steps": STEPS, "bytes": ROWS * COLUMNS * 4, "events": tf_rdma_events(log_dir)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
