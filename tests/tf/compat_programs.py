"""Programs for test_compatibility.py: `python compat_programs.py FUNCTION JSON_ARGS`, as
programs.py. Each reproduces a behaviour users rely on with tf.distribute.Server."""
import json
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


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
