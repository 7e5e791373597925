"""Runs in the two linked Soft-RoCE guests (tools/softroce/guest.py run_linked): a TF1 session with
the ps on guest-a and the worker on guest-b, once over gRPC and once over tf_rdma with
TF_RDMA_BACKEND=auto.

Each guest runs ONE process holding both its gRPC server and its tf_rdma server (of two clusters
on different ports): `import tensorflow` under emulation costs minutes of CPU, and two imports per
guest on a 2-core host more than doubled the run (measured: 531 s with four processes running
tests/tf/programs/tasks.py's compare_worker, against the ~5 minutes CI can spare for the two-host tests).
For the same reason the graph is small: a few SGD steps of a linear model whose variables live on
the ps, a cond whose branches run on the ps (dead tensors cross), and the values read back.

usage: tf_across_hosts.py ps|worker PS_IP WORKER_IP

ps: serves until the worker guest's command has ended (SOFTROCE_SHARED/guest-b.exit), then prints
"RESULT " and its tf_rdma stats as JSON. worker: runs the session over each transport and prints
"RESULT " and {"grpc": digest, "rdma": digest, "stats": its tf_rdma stats}.
"""
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# Fixed ports: each guest is a fresh kernel with nothing else listening. tf_rdma listens at +1000.
PORTS = {"grpc": (2222, 2223), "rdma": (3222, 3223)}
STEPS = 4
TIMEOUT = float(os.environ.get("TF_ACROSS_HOSTS_TIMEOUT", "900"))
PS, WORKER = "/job:ps/task:0", "/job:worker/task:0"


def servers(tf, ps_ip, worker_ip, job):
    import tf_rdma
    clusters = {t: {"ps": [f"{ps_ip}:{ps}"], "worker": [f"{worker_ip}:{worker}"]} for t, (ps, worker) in PORTS.items()}
    return {"grpc": tf.distribute.Server(clusters["grpc"], job_name=job, task_index=0),
            "rdma": tf_rdma.Server(clusters["rdma"], job_name=job, task_index=0)}


def train(tf, target):
    """{name: array} after STEPS SGD steps of a linear model on the ps, computed on the worker."""
    rng = np.random.default_rng(11)
    x, y = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            w = tf.compat.v1.Variable(rng.standard_normal((64, 8)).astype(np.float32), name="w")
            b = tf.compat.v1.Variable(np.zeros(8, np.float32), name="b")
            step = tf.compat.v1.Variable(np.int64(0), name="step")
            counts = tf.compat.v1.Variable(rng.integers(-1000, 1000, 100).astype(np.int32), name="counts")
            scale = tf.compat.v1.Variable(rng.standard_normal(16), name="scale")  # float64
        with tf.device(WORKER):
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
            grad_w, grad_b = tf.gradients(loss, [w, b])
        with tf.device(PS):
            update = tf.group(w.assign_sub(0.05 * grad_w), b.assign_sub(0.05 * grad_b), step.assign_add(1))
        with tf.device(WORKER):
            pred = tf.compat.v1.placeholder(tf.bool, shape=())

            def on_ps(fn):
                def branch():
                    with tf.device(PS):
                        value = fn()
                    with tf.device(WORKER):
                        return value + 1.0
                return branch

            chosen = tf.compat.v1.cond(pred, on_ps(lambda: scale * 3.0), on_ps(lambda: scale - 3.0))
            read = {name: tf.identity(v) for name, v in
                    {"w": w, "b": b, "step": step, "counts": counts, "scale": scale}.items()}
        results = {}
        with tf.compat.v1.Session(target) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for i in range(STEPS):
                results[f"loss_{i}"] = sess.run([update, loss])[1]
            results["cond_true"] = sess.run(chosen, {pred: True})
            results["cond_false"] = sess.run(chosen, {pred: False})
            results.update(sess.run(read))
    return {k: np.asarray(v) for k, v in results.items()}


def digest(arrays):
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def main(role, ps_ip, worker_ip):
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.disable_control_flow_v2()  # v1 cond: its untaken branch's tensors cross dead
    started = time.monotonic()
    held = servers(tf, ps_ip, worker_ip, role)
    if role == "ps":
        worker_done = Path(os.environ["SOFTROCE_SHARED"]) / "guest-b.exit"
        while not worker_done.exists():
            if time.monotonic() - started > TIMEOUT:
                print(f"the worker did not finish within {TIMEOUT:.0f} s", flush=True)
                return 1
            time.sleep(0.5)
        print("RESULT " + json.dumps(tf_rdma.stats()), flush=True)
        os._exit(0)  # the servers would wait for a peer that is gone
    results = {t: train(tf, held[t].target) for t in ("grpc", "rdma")}
    print("RESULT " + json.dumps({"grpc": digest(results["grpc"]), "rdma": digest(results["rdma"]),
                                  "stats": tf_rdma.stats()}), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
