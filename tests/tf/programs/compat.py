"""Programs for test_compatibility.py: `python compat.py FUNCTION JSON_ARGS`, as
tasks.py. Each reproduces a behaviour users rely on with tf.distribute.Server."""
import json
import os
import sys


def two_servers_on_any_free_port(cluster, job, index, output):
    """Two servers on localhost:0 in one process, as TensorFlow's create_local_server makes them."""
    import tf_rdma
    servers = [tf_rdma.Server({"local": ["localhost:0"]}, job_name="local", task_index=0) for _ in range(2)]
    with open(output, "w") as f:
        json.dump({"targets": [s.target for s in servers]}, f)


def error_class(cluster, job, index, output):
    """The class of the error a malformed cluster address raises."""
    import tf_rdma
    try:
        tf_rdma.Server({"worker": ["no-port-here"]}, job_name="worker", task_index=0)
        outcome = {"error": None}
    except Exception as e:  # the class under test, whatever it is
        outcome = {"error": type(e).__name__, "message": str(e)}
    with open(output, "w") as f:
        json.dump(outcome, f)


def second_server_for_a_task(cluster, job, index, output):
    """The class of the error a second server for a task already served in this process raises,
    from TensorFlow's server and from tf_rdma's (each on a port of its own)."""
    import tensorflow as tf
    import tf_rdma
    outcome = {}
    for name, make, spec in (("stock", tf.distribute.Server, cluster["stock"]),
                             ("tf_rdma", tf_rdma.Server, cluster["tf_rdma"])):
        make({"worker": spec}, job_name="worker", task_index=0)
        try:
            make({"worker": spec}, job_name="worker", task_index=0)
            outcome[name] = {"error": None}
        except Exception as e:  # the class under test, whatever it is
            outcome[name] = {"error": type(e).__name__, "message": str(e)}
    with open(output, "w") as f:
        json.dump(outcome, f)


def two_clusters_one_after_the_other(cluster, job, index, output):
    """An eager client connects to cluster "one", computes there, then to cluster "two" of another
    shape, and computes there: each remote result is copied back to it."""
    import numpy as np
    import tensorflow as tf
    import tf_rdma
    sums = {}
    for name in ("one", "two"):
        tf_rdma.connect_to_cluster(tf.train.ClusterSpec({name: cluster[name]}))
        for task in range(len(cluster[name])):
            with tf.device(f"/job:{name}/task:{task}"):
                remote = tf.constant(np.arange(1000, dtype=np.float32)) * (task + 2)
            sums[f"{name}/{task}"] = float(np.sum(remote.numpy()))
    with open(output, "w") as f:
        json.dump({"sums": sums, "stats": tf_rdma.stats()}, f)


def serve_as_local_server(cluster, job, index, stats_file):
    """A server of its own one-task cluster, as TensorFlow's create_local_server makes it; its stats
    written to `stats_file` until the test kills it."""
    import time
    import tf_rdma
    tf_rdma.Server({"local": [cluster[job][index]]}, job_name="local", task_index=0)
    while True:
        with open(stats_file + ".tmp", "w") as f:
            json.dump(tf_rdma.stats(), f)
        os.replace(stats_file + ".tmp", stats_file)
        time.sleep(0.5)


def session_with_its_own_cluster(cluster, job, index, output):
    """TF1 ClusterSpec propagation: a session whose ConfigProto.cluster_def names the local servers
    "worker" 0 and 1; a variable on one, its sum on the other."""
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    config = tf.compat.v1.ConfigProto()
    config.cluster_def.CopyFrom(tf.train.ClusterSpec({"worker": cluster["server"]}).as_cluster_def())
    with tf.device("/job:worker/task:1"):
        values = tf.Variable(np.arange(1000, dtype=np.float32))
    with tf.device("/job:worker/task:0"):
        total = tf.reduce_sum(values * 2)
    with tf.compat.v1.Session(f"grpc://{cluster['server'][0]}", config=config) as session:
        session.run(values.initializer)
        result = float(session.run(total))
    with open(output, "w") as f:
        json.dump({"sum": result}, f)
    os._exit(0)  # closing would ask the servers to deregister, which the test does not wait for


def eager_client_renaming_jobs(cluster, job, index, output):
    """An eager client naming each server by a job name it was not started with: one sorts after the
    client's own job ("trainer"), one before ("aaa"), so either side would connect."""
    import numpy as np
    import tensorflow as tf
    import tf_rdma
    sums = {}
    for name, address in zip(("trainer", "aaa"), cluster["worker"]):
        tf_rdma.connect_to_cluster(tf.train.ClusterSpec({name: [address]}))
        with tf.device(f"/job:{name}/task:0"):
            remote = tf.constant(np.arange(1000, dtype=np.float32)) * 2
        sums[name] = float(np.sum(remote.numpy()))
    with open(output, "w") as f:
        json.dump({"sums": sums, "stats": tf_rdma.stats()}, f)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
