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


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
