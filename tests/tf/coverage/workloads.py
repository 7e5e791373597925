"""The workloads whose cross-task bytes the coverage harness measures. Each runs a whole cluster
(every task a process) on this host and returns what the harness compares and counts:

    run(transport, out_dir) -> {"results": .npz path (compared bit by bit between transports),
                                "stats": {task: tf_rdma.stats() or its per-process summary}}

Sizes are chosen so that each run stays short on 2 cores yet moves enough tensor bytes
(hundreds of MB) that TensorFlow's fixed control traffic (session and function setup, one small
RPC per step) can sit below 0.1% of them once tf_rdma carries every tensor.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests import with_optional_packages
from tests.tf.programs.cluster import Cluster

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import cluster_utils as cu  # noqa: E402  examples/: the launchers' supervisor (examples is no package)


class Workload:
    def __init__(self, name, title, run, min_tensor_bytes, deterministic=True):
        self.name, self.title, self.run = name, title, run
        # False where two gRPC runs already differ: their digests cannot compare transports.
        self.deterministic = deterministic
        # A floor on the tensor bytes the workload must move (from its sizes): a measurement
        # below it means the harness, not the transport, is broken.
        self.min_tensor_bytes = min_tensor_bytes


# Without it, two gRPC runs of the embedding loop differ in a few table entries (sparse updates
# of repeated ids), so digests could not tell transports apart; with it they are bit-identical.
# TensorFlow's own switch, in every process of the clusters below that run tasks.py or
# tf2_ps_keras.py (it does not make Keras fit under ParameterServerStrategy reproducible).
DETERMINISTIC = {"TF_DETERMINISTIC_OPS": "1"}


def _wait_for_stats(path, timeout=10):
    """The last stats a `programs.serve` task dumped (it rewrites the file every 0.5 s)."""
    time.sleep(1.0)     # one more dump after the client finished
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"no tf_rdma stats were written to {path}")
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


def _program_cluster(out_dir, transport, jobs, client, function, timeout, **kwargs):
    """Serving tasks run programs.serve (with a stats file for rdma); `client` (job, index) runs
    programs.<function>, which writes output.npz and output.npz.stats.json."""
    output = str(out_dir / "results.npz")
    stats = {}
    with Cluster(out_dir, jobs, env=DETERMINISTIC) as cluster:
        servers = [(job, i) for job, n in jobs.items() for i in range(n) if (job, i) != client]
        for job, i in servers:
            stats_file = str(out_dir / f"{job}{i}-stats.json") if transport == "rdma" else None
            cluster.start(job, i, "serve", transport=transport, stats_file=stats_file)
        cluster.start(*client, function, transport=transport, output=output, **kwargs)
        code = cluster.wait(*client, timeout=timeout)
        if code != 0:
            logs = "\n".join(f"--- {j}{i} ---\n{cluster.log(j, i)[-2500:]}" for j, i in [client] + servers)
            raise AssertionError(f"{client[0]}{client[1]} exited with {code}:\n{logs}")
        if transport == "rdma":
            for job, i in servers:
                stats[f"{job}{i}"] = _wait_for_stats(str(out_dir / f"{job}{i}-stats.json"))
    with open(output + ".stats.json") as f:
        stats["/".join(map(str, client))] = json.load(f)
    return {"results": output, "stats": stats if transport == "rdma" else {}}


def _launcher(script, out_dir, transport, *args, timeout):
    """Runs an example's --launch-local with --json; returns its JSON document."""
    argv = [sys.executable, str(script), "--launch-local", "--transport", transport, "--json",
            "--log-dir", str(out_dir / "logs"), *map(str, args)]
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=with_optional_packages(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")))
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = {"ok": False}
    if proc.returncode != 0 or not doc.get("ok"):
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return doc


# ---------------------------------------------------------------------------------------------

TF1_HIDDEN, TF1_STEPS = 32768, 8


def tf1_ps(transport, out_dir):
    # One worker, so the steps apply in order and the weights are deterministic.
    return _program_cluster(out_dir, transport, {"ps": 1, "worker": 1}, ("worker", 0),
                            "train_worker", timeout=300, steps=TF1_STEPS, hidden=TF1_HIDDEN,
                            learning_rate=0.05)


# Keras registers its step functions on the ps and worker once, about 2 MB of gRPC control calls;
# after that each step costs ~6 KB of control calls against 42 MB of tensors. 100 steps make the
# measurement a training run's rather than a start-up's.
PSS_KERAS_STEPS, PSS_KERAS_HIDDEN = 100, (2048, 2048)


def pss_keras_fit(transport, out_dir):
    """examples/tf2_ps_keras.py's ps and worker tasks, and its coordinator through
    ps_keras_chief.py (which also saves the weights). One worker: deterministic order."""
    cluster = cu.local_cluster(1, 1, extra_jobs=[("chief", 1)], transport=transport)
    output = str(out_dir / "results.npz")
    common = ["--cluster", cu.format_cluster(cluster), "--transport", transport, "--events",
              "--steps", PSS_KERAS_STEPS, "--eval-every", PSS_KERAS_STEPS, "--warmup-steps", 2,
              "--hidden", ",".join(map(str, PSS_KERAS_HIDDEN))]
    stats = {}
    with cu.LocalCluster(str(out_dir / "logs"),
                         with_optional_packages(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **DETERMINISTIC))) as lc:
        for job in ("ps", "worker"):
            lc.start(f"{job}0", cu.python_argv(str(EXAMPLES / "tf2_ps_keras.py"), "--job", job,
                                               "--task", 0, *common), daemon=True)
        lc.start("chief", cu.python_argv(str(HERE / "ps_keras_chief.py"), output, "--job",
                                         "chief", "--task", 0, *common))
        lc.wait(until=["chief"], timeout=400, stall_timeout=240)
    for name, event in lc.drain():      # the servers report tf_rdma's stats as they stop
        if event.get("kind") == "rdma_stats":
            stats[name] = event["stats"]
    if transport == "rdma":
        with open(output + ".stats.json") as f:
            stats["chief"] = json.load(f)
        missing = {"ps0", "worker0"} - set(stats)
        assert not missing, f"no tf_rdma stats from {missing}"
    return {"results": output, "stats": stats}


EMBEDDING = dict(steps=10, vocab=200_000, dim=64, batch=1024, ids_per_example=32)


def pss_embedding(transport, out_dir):
    return _program_cluster(out_dir, transport, {"chief": 1, "ps": 2, "worker": 1}, ("chief", 0),
                            "embedding_coordinator", timeout=400, **EMBEDDING)


MWMS_STEPS, MWMS_HIDDEN = 8, (2048, 2048)


def mwms(loop):
    def run(transport, out_dir):
        output = str(out_dir / "results.npz")
        doc = _launcher(EXAMPLES / "tf2_mwms_keras.py", out_dir, transport, "--loop", loop,
                        "--steps", MWMS_STEPS, "--warmup-steps", 2, "--save", output,
                        "--hidden", ",".join(map(str, MWMS_HIDDEN)), timeout=400)
        return {"results": output, "stats": {k: v for k, v in doc["rdma_stats"].items() if v}}
    return run


EAGER = dict(rounds=4, mib=8)


def eager(local_to_remote):
    def run(transport, out_dir):
        output = str(out_dir / "results.npz")
        doc = _launcher(EXAMPLES / "eager_remote.py", out_dir, transport, "--save", output,
                        "--rounds", EAGER["rounds"], "--mib", EAGER["mib"],
                        "--local-to-remote", local_to_remote, timeout=300)
        return {"results": output, "stats": doc["rdma_stats"]}
    return run


def _mlp_parameters(hidden):
    return cu.mlp_parameter_count(list(hidden))


WORKLOADS = {w.name: w for w in [
    # Per step, the weights ps->worker and the gradients worker->ps.
    Workload("tf1_ps", "TF1 parameter server (session, 1 ps + 1 worker)", tf1_ps,
             TF1_STEPS * 2 * 4 * 74 * TF1_HIDDEN),
    # Per step, at least the weights ps->worker and the gradients worker->ps; the coordinator
    # also creates the variables (model and Adam slots) and evaluates.
    # Not deterministic yet: two gRPC runs (one worker, TF_DETERMINISTIC_OPS=1) give different
    # losses from the first fit epoch on; the cause is not found yet.
    Workload("pss_keras_fit", "TF2 PSS Keras fit incl. coordinator (1 ps + 1 worker)", pss_keras_fit,
             PSS_KERAS_STEPS * 2 * 4 * _mlp_parameters(PSS_KERAS_HIDDEN), deterministic=False),
    # Per step, the looked-up rows ps->worker and their gradients worker->ps.
    Workload("pss_embedding", "TF2 PSS custom loop, 200k x 64 embedding over 2 ps", pss_embedding,
             EMBEDDING["steps"] * 2 * 4 * EMBEDDING["batch"] * EMBEDDING["ids_per_example"]
             * EMBEDDING["dim"]),
    # Per step, ring all-reduce: each of the 2 workers sends the other half the gradient twice
    # (reduce-scatter, then all-gather).
    Workload("mwms_fit", "MultiWorkerMirroredStrategy Keras fit, 2 workers", mwms("fit"),
             MWMS_STEPS * 2 * 4 * _mlp_parameters(MWMS_HIDDEN)),
    Workload("mwms_custom", "MultiWorkerMirroredStrategy custom loop, 2 workers", mwms("custom"),
             MWMS_STEPS * 2 * 4 * _mlp_parameters(MWMS_HIDDEN)),
    # Per round, 4 tensors remote->local and 1 local->remote (examples/eager_remote.py).
    Workload("eager", "Eager remote copies both ways (TensorFlow's default)", eager("enqueue"),
             EAGER["rounds"] * 5 * EAGER["mib"] * 2**20),
    Workload("eager_rendezvous", "Eager remote copies, TF_EAGER_REMOTE_USE_SEND_TENSOR_RPC=0",
             eager("rendezvous"), EAGER["rounds"] * 5 * EAGER["mib"] * 2**20),
]}
