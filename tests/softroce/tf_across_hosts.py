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

Then, over each transport in the same processes (issue 27), partitions (link_impairment.Partition,
everything on the link dropped both ways at guest-b's end): one step of a small session begun as
the link is cut for LONG_PARTITION_S, longer than the peer timeout (PEER_TIMEOUT_MS, both guests):
how it fails and when; then, healed, the training again from the start with a partition of
SHORT_PARTITION_S during one of its steps: the results must not change, and tf_rdma must neither
fail nor replace its connection for it. Last, the training again with the link impaired
(link_impairment.py: 1% loss, 1% duplication, 20 ms +- 5 ms, on both guests' egress): the results must not
change, and the step rates under the impairment compare tf_rdma (verbs) with gRPC.

usage: tf_across_hosts.py ps|worker PS_IP WORKER_IP

ps: serves until the worker guest's command has ended (SOFTROCE_SHARED/guest-b.exit), impairing
its side of the link when the worker asks (SOFTROCE_SHARED/impair), then prints "RESULT " and its
tf_rdma stats as JSON. worker: runs the session over each transport, unimpaired then impaired, and
prints "RESULT " and {"digests": {"grpc"|"rdma" + ""|"_after_partition"|"_impaired": digest},
"steps_per_second": {the same keys: rate}, "long_partition": {"grpc"|"rdma": {"error", "message",
"failed_after_s"}}, "short_partition": {"grpc"|"rdma": {"step_s"; for rdma "peer_before",
"peer_after": the ps's peer stats around the step}}, "stats": its tf_rdma stats}.
"""
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
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
PS_TASK = "/job:ps/replica:0/task:0"  # as tf_rdma's stats and errors name it
PEER_TIMEOUT_MS = 4000  # TF_RDMA_PEER_TIMEOUT_MS on both guests (test_two_hosts.py sets it)
# A step caught by a partition longer than the peer timeout: tf_rdma must fail it within the peer
# timeout plus the emulated guests' slack (verbs_faults_across_hosts.py's); gRPC, with no keepalive
# set, waits for the step's deadline, set beyond that.
LONG_PARTITION_SLACK_S = 4.0
STEP_DEADLINE_MS = 9000
LONG_PARTITION_S = 10.0
SHORT_PARTITION_S = 1.0  # a quarter of the peer timeout: TCP's retransmission after it comes well within
SHORT_PARTITION_STEP = 5


def servers(tf, ps_ip, worker_ip, job):
    import tf_rdma
    clusters = {t: {"ps": [f"{ps_ip}:{ps}"], "worker": [f"{worker_ip}:{worker}"]} for t, (ps, worker) in PORTS.items()}
    return {"grpc": tf.distribute.Server(clusters["grpc"], job_name=job, task_index=0),
            "rdma": tf_rdma.Server(clusters["rdma"], job_name=job, task_index=0)}


def train(tf, target, fault=None):
    """({name: array} after STEPS SGD steps of a linear model on the ps, computed on the worker;
    the steps per second after the first, which also sets the session up). `fault`: a context
    manager wrapped around step SHORT_PARTITION_STEP."""
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
                with fault if fault and i == SHORT_PARTITION_STEP else contextlib.nullcontext():
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


@contextlib.contextmanager
def partitioned_for(seconds, record, peer_stats=None):
    """Cuts the link as the block begins and heals it `seconds` later, whether or not the block has
    ended, and waits for the heal before going on. Records the block's time and, with `peer_stats`,
    the ps's peer record before and after."""
    if peer_stats:
        record["peer_before"] = peer_stats()
    partition = link_impairment.Partition(link_impairment.EVERYTHING).__enter__()
    heal_errors = []

    def heal():
        try:
            partition.__exit__(None, None, None)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            heal_errors.append(e)

    healer = threading.Timer(seconds, heal)
    healer.start()
    try:
        yield
        record["step_s"] = time.monotonic() - partition.started
    finally:
        healer.join()
        if heal_errors:
            raise RuntimeError(f"the partition could not be healed: {heal_errors[0]}")
    if peer_stats:
        record["peer_after"] = peer_stats()


def step_across_long_partition(tf, target):
    """One step of a small session (a tensor from the ps to the worker) begun as the link is cut
    for LONG_PARTITION_S; returns how it ended ("error": its class or None, "message",
    "failed_after_s" into the partition), once the link is healed."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            v = tf.compat.v1.Variable(np.arange(1024, dtype=np.float32), name="across")
            doubled = v * 2.0
        with tf.device(WORKER):
            read = doubled + 1.0
    with tf.compat.v1.Session(target, graph=graph) as sess:
        sess.run(v.initializer)
        sess.run(read)  # the connections are up before the cut
        with link_impairment.Partition(link_impairment.EVERYTHING) as partition:
            try:
                sess.run(read, options=tf.compat.v1.RunOptions(timeout_in_ms=STEP_DEADLINE_MS))
                outcome = {"error": None, "message": ""}
            except tf.errors.OpError as e:
                outcome = {"error": type(e).__name__, "message": str(e)[:2000]}
            outcome["failed_after_s"] = time.monotonic() - partition.started
            time.sleep(max(0.0, LONG_PARTITION_S - (time.monotonic() - partition.started)))
    return outcome


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
    digests, rates, long_partition, short_partition = {}, {}, {}, {}

    def run(name, target, fault=None):
        results, rates[name] = train(tf, target, fault)
        digests[name] = digest(results)

    def ps_peer_stats():
        return tf_rdma.stats()["peers"].get(PS_TASK)

    for t in ("grpc", "rdma"):
        run(t, held[t].target)
    for t in ("grpc", "rdma"):
        long_partition[t] = step_across_long_partition(tf, held[t].target)
        short_partition[t] = {}
        run(t + "_after_partition", held[t].target,
            partitioned_for(SHORT_PARTITION_S, short_partition[t], ps_peer_stats if t == "rdma" else None))
    impair_link(shared)
    for t in ("grpc", "rdma"):
        run(t + "_impaired", held[t].target)
    print("RESULT " + json.dumps({"digests": digests, "steps_per_second": rates, "long_partition": long_partition,
                                  "short_partition": short_partition, "stats": tf_rdma.stats()}), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
