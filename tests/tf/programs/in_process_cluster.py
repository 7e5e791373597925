"""A whole cluster in one process (1 ps + 2 workers as three servers, the way TensorFlow's own
distributed tests build theirs), training synchronously with a TF1 session; saves the losses and the
final weights, and each server's tf_rdma stats.

    python in_process_cluster.py grpc|rdma OUTPUT.npz
"""
import json
import sys

import numpy as np

from tests.tf.programs.cluster import free_ports


def main(transport, output):
    import tensorflow as tf
    ports = free_ports(3)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}", f"localhost:{ports[2]}"]}
    if transport == "rdma":
        import tf_rdma
        server_class = tf_rdma.Server
    else:
        server_class = tf.distribute.Server
    servers = [server_class(cluster, job_name=job, task_index=index)
               for job, index in (("ps", 0), ("worker", 0), ("worker", 1))]
    tf.compat.v1.disable_eager_execution()
    with tf.device("/job:ps/task:0"):
        weights = tf.Variable(tf.zeros([100, 10]))
    losses = []
    for index in range(2):
        with tf.device(f"/job:worker/task:{index}"):
            features = tf.random.stateless_normal([32, 100], seed=[index, 1])
            error = tf.matmul(features, weights) - 1.0
            losses.append(tf.reduce_mean(error * error))
    with tf.device("/job:ps/task:0"):
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.add_n(losses))
    results = {}
    with tf.compat.v1.Session(servers[1].target) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for step in range(20):
            results[f"losses/{step}"] = np.array(session.run([train] + losses)[1:])
        results["weights"] = session.run(weights)
    np.savez(output, **results)
    if transport == "rdma":
        with open(output + ".stats.json", "w") as f:
            json.dump(tf_rdma.stats(), f)


if __name__ == "__main__":
    main(*sys.argv[1:])
