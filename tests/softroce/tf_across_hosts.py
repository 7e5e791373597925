"""Runs in the two linked Soft-RoCE guests (tools/softroce/guest.py run_linked): a TF1 session with
the ps on guest-a and the worker on guest-b, once over gRPC and once over tf_rdma with
TF_RDMA_BACKEND=auto.

Each guest runs ONE process holding both its gRPC server and its tf_rdma server (of two clusters
on different ports): `import tensorflow` under emulation costs minutes of CPU, and two imports per
guest on a 2-core host more than doubled the run (measured: 531 s with four processes running
tests/tf/programs/tasks.py's compare_worker, against the ~5 minutes CI can spare for the two-host tests).
For the same reason the graph is small: a few SGD steps of a linear model whose variables live on
the ps, a cond whose branches run on the ps (dead tensors cross), tensors of changing shapes both
ways (small, then growing: the receiver's grants after the header grow and shrink), strings, an
empty tensor, and the values read back.

Then the same again with the link impaired (link_impairment.py: 1% loss, 20 ms +- 5 ms, on both
guests' egress; issue 27), over each transport in the same processes: the results must not
change, and the step rates under the impairment compare tf_rdma (verbs) with gRPC.

usage: tf_across_hosts.py ps|worker PS_IP WORKER_IP

ps: serves until the worker guest's command has ended (SOFTROCE_SHARED/guest-b.exit), impairing
its side of the link when the worker asks (SOFTROCE_SHARED/impair), then prints "RESULT " and its
tf_rdma stats as JSON. worker: runs the session over each transport, unimpaired then impaired, and
prints "RESULT " and {"digests": {"grpc"|"rdma"|"grpc_impaired"|"rdma_impaired": digest},
"steps_per_second": {the same keys: rate}, "stats": its tf_rdma stats}.
"""
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.softroce import link_impairment

# Fixed ports: each guest is a fresh kernel with nothing else listening. tf_rdma listens at +1000.
PORTS = {"grpc": (2222, 2223), "rdma": (3222, 3223)}
STEPS = 12
TIMEOUT = float(os.environ.get("TF_ACROSS_HOSTS_TIMEOUT", "900"))
IMPAIR_TIMEOUT = 60.0  # s for the other guest to answer about the impairment
PS, WORKER = "/job:ps/task:0", "/job:worker/task:0"


def servers(tf, ps_ip, worker_ip, job):
    import tf_rdma
    clusters = {t: {"ps": [f"{ps_ip}:{ps}"], "worker": [f"{worker_ip}:{worker}"]} for t, (ps, worker) in PORTS.items()}
    return {"grpc": tf.distribute.Server(clusters["grpc"], job_name=job, task_index=0),
            "rdma": tf_rdma.Server(clusters["rdma"], job_name=job, task_index=0)}


def train(tf, target):
    """({name: array} after STEPS SGD steps of a linear model on the ps, computed on the worker;
    the steps per second after the first, which also sets the session up)."""
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
            dynamic = tf.compat.v1.placeholder(tf.float32, shape=None)
        with tf.device(PS):
            on_ps = dynamic * 3.0
            # Variables, not constants: a constant would be folded on the worker and never cross.
            names = tf.compat.v1.Variable(np.array([b"", b"ps", b"x" * 300], dtype=object), name="names")
            empty = tf.compat.v1.Variable(np.zeros((0, 7), np.float32), name="empty")
        with tf.device(WORKER):
            dynamic_back = on_ps + 1.0
            strings_and_empty = (tf.identity(names), tf.concat([empty, empty], 0))
            read = {name: tf.identity(v) for name, v in
                    {"w": w, "b": b, "step": step, "counts": counts, "scale": scale}.items()}
        results = {}
        with tf.compat.v1.Session(target) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for i in range(STEPS):
                if i == 1:
                    timed = time.monotonic()
                results[f"loss_{i}"] = sess.run([update, loss])[1]
            steps_per_second = (STEPS - 1) / (time.monotonic() - timed)
            results["cond_true"] = sess.run(chosen, {pred: True})
            results["cond_false"] = sess.run(chosen, {pred: False})
            # Both ways across: shapes that ride in their header's message, then larger ones (the
            # ps's receiver grants data after the header, grows the grant, takes it back), an empty one.
            for i, shape in enumerate([(2, 3), (64, 128), (256, 256), (2, 3), (0, 4)]):
                results[f"dynamic_{i}"] = sess.run(dynamic_back, {dynamic: np.full(shape, i, np.float32)})
            results["strings"], results["empty"] = sess.run(strings_and_empty)
            results["strings"] = np.frombuffer(b"|".join(results["strings"]), np.uint8)
            results.update(sess.run(read))
    return {k: np.asarray(v) for k, v in results.items()}, steps_per_second


def digest(arrays):
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def wait_for(path, what):
    deadline = time.monotonic() + IMPAIR_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ({path}) did not come within {IMPAIR_TIMEOUT:.0f} s")
        time.sleep(0.2)


def announce(path, text):
    """Writes `text` to `path` at once (the other guest polls for it)."""
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").rename(path)


def impair_link(shared):
    """Impairs the worker's side of the link, then has the ps impair its side."""
    link_impairment.impair_here()
    announce(shared / "impair", "")
    wait_for(shared / "impaired", "the ps's side of the impairment")
    answer = (shared / "impaired").read_text()
    if answer != "ok":
        raise RuntimeError(f"the ps could not impair its side of the link: {answer}")


def main(role, ps_ip, worker_ip):
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.disable_control_flow_v2()  # v1 cond: its untaken branch's tensors cross dead
    started = time.monotonic()
    shared = Path(os.environ["SOFTROCE_SHARED"])
    held = servers(tf, ps_ip, worker_ip, role)
    if role == "ps":
        worker_done, impaired = shared / "guest-b.exit", False
        while not worker_done.exists():
            if time.monotonic() - started > TIMEOUT:
                print(f"the worker did not finish within {TIMEOUT:.0f} s", flush=True)
                return 1
            if not impaired and (shared / "impair").exists():
                impaired = True
                try:
                    link_impairment.impair_here()
                    announce(shared / "impaired", "ok")
                except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                    announce(shared / "impaired", str(e))
            time.sleep(0.5)
        print("RESULT " + json.dumps(tf_rdma.stats()), flush=True)
        os._exit(0)  # the servers would wait for a peer that is gone
    digests, rates = {}, {}
    for impaired in (False, True):
        if impaired:
            impair_link(shared)
        for t in ("grpc", "rdma"):
            name = t + ("_impaired" if impaired else "")
            results, rates[name] = train(tf, held[t].target)
            digests[name] = digest(results)
    print("RESULT " + json.dumps({"digests": digests, "steps_per_second": rates, "stats": tf_rdma.stats()}),
          flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
