"""1 ps and WORKERS workers as servers of one process: each worker sends the ps one large tensor
once, then the cluster goes quiet; then worker 0 sends it again. Prints (one JSON line) what the ps's
receive pools held and the process's memory right after the first step, once they went quiet, and
after the later step, with that step's result.

    TF_RDMA_RECEIVE_POOL_IDLE_MS=... python quiet_workers.py WORKERS ELEMENTS WAIT_SECONDS
"""
import json
import sys
import time

PS = "/job:ps/replica:0/task:0"


def ps_region_bytes(tf_rdma):
    ps = next(server for server in tf_rdma.stats()["servers"] if server["task"] == PS)
    return sum(pool["region_bytes"] for pool in ps["receive_pools"].values())


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def shared_region_bytes():
    """Bytes of the shm backend's regions this process maps: the ps's own, and the workers' maps of
    them (each a mapping of a memfd named tf_rdma-region)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:tf_rdma-region" in line:
                start, end = (int(address, 16) for address in line.split()[0].split("-"))
                total += end - start
    return total


def memory(tf_rdma):
    return {"region_bytes": ps_region_bytes(tf_rdma), "rss": rss_bytes(), "shared": shared_region_bytes()}


def main(workers, elements, wait_seconds):
    import tensorflow as tf
    import tf_rdma
    from tests.tf.programs.cluster import free_ports
    ports = free_ports(workers + 1)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{port}" for port in ports[1:]]}
    servers = [tf_rdma.Server(cluster, job_name="ps", task_index=0)]
    servers += [tf_rdma.Server(cluster, job_name="worker", task_index=index) for index in range(workers)]
    tf.compat.v1.disable_eager_execution()
    sums = []
    for index in range(workers):
        with tf.device(f"/job:worker/task:{index}"):
            sent = tf.range(elements, dtype=tf.int64) * (index + 1)
        with tf.device("/job:ps/task:0"):
            sums.append(tf.reduce_sum(sent))
    outcome = {}
    with tf.compat.v1.Session(servers[1].target) as session:
        outcome["first"] = [int(s) for s in session.run(sums)]
        outcome["after_step"] = memory(tf_rdma)
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            quiet = memory(tf_rdma)
            if quiet["region_bytes"] == 0 and quiet["shared"] == 0:
                break
            time.sleep(0.1)
        outcome["quiet"] = quiet
        outcome["again"] = int(session.run(sums[0]))
        outcome["after_again"] = memory(tf_rdma)
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
