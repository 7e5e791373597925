"""tf_rdma's main demo: two real training jobs, each run once over gRPC and once over tf_rdma.

1. Parameter server: a whole cluster on this host as separate processes (1 ps, 2 workers, free
   ports) trains an MLP (64 -> 2048 -> 2048 -> 10, 4.35 M float32 parameters) on scikit-learn's
   digits with TF1 between-graph replication (examples/tf1_ps_training.py: variables and Adam
   updates on the ps, each worker a tf.compat.v1.Session(server.target)), so every step moves
   16.6 MiB of weights ps->worker and 16.6 MiB of gradients worker->ps per worker.
2. Synchronous data parallel: the same MLP with TF2 MultiWorkerMirroredStrategy and Keras
   model.fit on 2 worker processes (examples/tf2_mwms_keras.py), all-reducing 16.6 MiB of
   gradients every step.
It shows progress while training, then each job's throughput side by side.

    python examples/demo_cluster.py                       # grpc, then rdma
    python examples/demo_cluster.py --transports grpc --steps 50 --mwms-steps 0 --json
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster_utils as cu  # noqa: E402
import tf2_mwms_keras  # noqa: E402

TRAINER = os.path.join(HERE, "tf1_ps_training.py")
NUM_PS, NUM_WORKERS = 1, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps per worker (default 150)")
    p.add_argument("--mwms-steps", type=int, default=60,
                   help="MultiWorkerMirroredStrategy training steps (default 60; 0 skips that job)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--transports", default="grpc,rdma",
                   help="comma-separated, run in this order (default grpc,rdma)")
    p.add_argument("--hidden", default="2048,2048")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout (progress goes to stderr)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="fail a run when no task reports anything for this long")
    p.add_argument("--log-dir", help="keep the tasks' logs here (default: a temporary directory, "
                                     "removed after a successful run)")
    p.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)  # "ps0@10": SIGKILL ps0
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    for t in args.transports:
        if t not in cu.TRANSPORTS:
            p.error(f"unknown transport {t!r}; expected {', '.join(cu.TRANSPORTS)}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


class Progress:
    """Turns the tasks' events into progress lines and collects their results."""

    def __init__(self, transport, args, lc, out):
        self.transport, self.args, self.lc, self.out = transport, args, lc, out
        self.rates = {}
        self.results = {}
        self.evals = []
        self.pids = {}
        self.failure = None
        if args.inject_failure:
            name, _, step = args.inject_failure.partition("@")
            self.failure = (name, int(step or 1))

    def say(self, msg):
        print(f"[{self.transport}] {msg}", file=self.out, flush=True)

    def __call__(self, name, ev):
        kind = ev.get("kind")
        if kind in ("serving", "ready"):
            self.pids[name] = ev.get("pid")
            self.say(f"{name} {kind} (pid {ev.get('pid')})")
        elif kind == "step":
            self.rates[name] = ev["steps_per_sec"]
            if self.failure and name == "worker0" and ev["step"] >= self.failure[1]:
                self.say(f"injecting a failure: SIGKILL {self.failure[0]}")
                self.lc.kill(self.failure[0])
                self.failure = None
        elif kind == "eval":
            self.evals.append(ev)
            rates = ", ".join(f"{n} {r:.2f}" for n, r in sorted(self.rates.items()))
            self.say(f"step {ev['step']:4d}/{self.args.steps} (global {ev['global_step']:4d})  "
                     f"train loss {ev['train_loss']:.4f}  test acc {ev['test_accuracy']:.4f}  "
                     f"[steps/s: {rates}]")
        elif kind == "result":
            self.results[name] = ev
            stats = ev.get("rdma_stats")
            if stats:
                self.say(f"{name}: tf_rdma carried {stats['tensors_sent']} tensors "
                         f"({stats['bytes_sent'] / 2**20:.0f} MiB) out and "
                         f"{stats['tensors_received']} ({stats['bytes_received'] / 2**20:.0f} MiB) "
                         f"in, backend {'/'.join(stats['backends']) or '-'}, "
                         f"{cu.count(stats.get('left_on_grpc', {}))} transfers left on gRPC")


def run_once(transport, args, out, pids):
    cluster = cu.local_cluster(NUM_PS, NUM_WORKERS, transport=transport)
    spec = cu.format_cluster(cluster)
    log_dir = os.path.join(args.log_root, transport)
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    common = ["--cluster", spec, "--transport", transport, "--events",
              "--steps", args.steps, "--batch-size", args.batch_size, "--hidden", args.hidden,
              "--eval-every", args.eval_every]
    t0 = time.monotonic()
    with cu.LocalCluster(log_dir, env) as lc:
        progress = Progress(transport, args, lc, out)
        progress.pids = pids
        progress.say(f"starting {NUM_PS} ps + {NUM_WORKERS} workers: {spec}")
        names = []
        for job, n in (("ps", NUM_PS), ("worker", NUM_WORKERS)):
            for i in range(n):
                name = f"{job}{i}"
                lc.start(name, cu.python_argv(TRAINER, "--job", job, "--task", i, *common))
                progress.pids[name] = lc.pid(name)
                names.append(name)
        lc.wait(until=names, timeout=args.timeout, stall_timeout=args.stall_timeout,
                on_event=progress)
    wall = time.monotonic() - t0
    workers = [progress.results[f"worker{i}"] for i in range(NUM_WORKERS)]
    chief = workers[0]
    window = max(w["window_end"] for w in workers) - min(w["window_start"] for w in workers)
    steps = sum(w["measured_steps"] for w in workers)
    run = {
        "transport": transport, "cluster": cluster, "wall_seconds": wall,
        # All workers together, over the wall-clock window in which they trained (warm-up excluded).
        "examples_per_sec": steps * args.batch_size / window,
        "steps_per_sec": steps / window,
        "measured_window_seconds": window,
        "final_test_accuracy": chief["final_test_accuracy"],
        "final_test_loss": chief["final_test_loss"],
        "global_step": chief["global_step"],
        "mib_per_step_each_way": chief["bytes_per_step"] / 2 / 2**20,
        "workers": workers, "evals": progress.evals, "pids": progress.pids,
    }
    if transport == "rdma":
        carried = sum((w.get("rdma_stats") or {}).get("bytes_received", 0) for w in workers)
        run["rdma_bytes_received_by_workers"] = carried
        if not carried:
            progress.say("WARNING: tf_rdma carried no tensor bytes: the transfers stayed on gRPC")
    progress.say(f"done in {wall:.1f} s: {run['examples_per_sec']:.0f} examples/s, "
                 f"{run['steps_per_sec']:.2f} steps/s, final test accuracy "
                 f"{run['final_test_accuracy']:.4f}")
    return run


PS_ROWS = [("examples/s (2 workers)", "examples_per_sec", "{:.0f}"),
           ("steps/s (2 workers)", "steps_per_sec", "{:.2f}"),
           ("final test accuracy", "final_test_accuracy", "{:.4f}"),
           ("wall time incl. startup (s)", "wall_seconds", "{:.1f}")]
MWMS_ROWS = [("examples/s (global batch)", "examples_per_sec", "{:.0f}"),
             ("steps/s", "steps_per_sec", "{:.2f}"),
             ("final test accuracy", "final_test_accuracy", "{:.4f}"),
             ("wall time incl. startup (s)", "wall_seconds", "{:.1f}")]


def summary_table(args, runs, rows=PS_ROWS):
    ok = [t for t in args.transports if "error" not in runs[t]]
    lines = []
    header = f"{'':28s}" + "".join(f"{t:>14s}" for t in args.transports)
    base = "grpc" if "grpc" in ok else None
    others = [t for t in ok if t != base] if base else []
    header += "".join(f"{t + '/' + base:>14s}" for t in others)
    lines.append(header)

    def row(label, key, fmt):
        cells = []
        for t in args.transports:
            cells.append(f"{fmt.format(runs[t][key]):>14s}" if t in ok else f"{'FAILED':>14s}")
        for t in others:
            cells.append(f"{runs[t][key] / runs[base][key]:>13.2f}x")
        lines.append(f"{label:28s}" + "".join(cells))

    for label, key, fmt in rows:
        row(label, key, fmt)
    return "\n".join(lines)


def run_mwms(transport, args, out):
    """The MultiWorkerMirroredStrategy job over `transport`: examples/tf2_mwms_keras.py's run."""
    mwms_args = tf2_mwms_keras.parse_args([
        "--launch-local", "--transport", transport, "--steps", str(args.mwms_steps),
        "--batch-size", str(args.batch_size), "--hidden", args.hidden, "--timeout", str(args.timeout),
        "--log-dir", os.path.join(args.log_root, f"mwms-{transport}")])
    summary = tf2_mwms_keras.run_local(mwms_args, out)
    if not summary["ok"]:
        return {"transport": transport, "error": "the MultiWorkerMirroredStrategy run failed"}
    result = summary["result"]
    return {"transport": transport, "wall_seconds": summary["wall_seconds"],
            "examples_per_sec": result["examples_per_sec"], "steps_per_sec": result["steps_per_sec"],
            "final_test_accuracy": result["final_test_accuracy"], "rdma_stats": summary["rdma_stats"]}


def main(argv=None):
    args = parse_args(argv)
    cu.raise_on_termination_signals()
    out = sys.stderr if args.json else sys.stdout
    keep_logs = bool(args.log_dir)
    args.log_root = args.log_dir or tempfile.mkdtemp(prefix="tf_rdma_demo_")
    runs, mwms_runs = {}, {}
    try:
        with cu.reporting_stops():
            for transport in args.transports:
                pids = {}
                try:
                    runs[transport] = run_once(transport, args, out, pids)
                except cu.ClusterFailed as e:
                    keep_logs = True
                    runs[transport] = {"transport": transport, "error": str(e), "pids": pids}
                    print(f"[{transport}] FAILED: {e}", file=out, flush=True)
            if args.mwms_steps:
                for transport in args.transports:
                    mwms_runs[transport] = run_mwms(transport, args, out)
                    keep_logs = keep_logs or "error" in mwms_runs[transport]
    finally:
        if not keep_logs:
            shutil.rmtree(args.log_root, ignore_errors=True)

    params = cu.mlp_parameter_count([int(h) for h in args.hidden.split(",")])
    print(f"\nMLP 64-{args.hidden.replace(',', '-')}-10 ({params / 1e6:.2f} M parameters) on "
          f"digits, {NUM_PS} ps + {NUM_WORKERS} workers, {args.steps} steps/worker, batch "
          f"{args.batch_size}; each step moves {4 * params / 2**20:.1f} MiB ps->worker and "
          f"{4 * params / 2**20:.1f} MiB worker->ps per worker", file=out)
    print(summary_table(args, runs), file=out)
    if mwms_runs:
        print(f"\nThe same MLP with MultiWorkerMirroredStrategy (Keras model.fit, 2 workers, "
              f"{args.mwms_steps} steps, batch {args.batch_size} per worker); each step all-reduces "
              f"{4 * params / 2**20:.1f} MiB of gradients", file=out)
        print(summary_table(args, mwms_runs, rows=MWMS_ROWS), file=out)
    failed = [t for t in args.transports if "error" in runs[t]]
    failed += [f"mwms-{t}" for t in mwms_runs if "error" in mwms_runs[t]]
    if failed:
        print(f"FAILED: {', '.join(failed)} (logs kept in {args.log_root})", file=out)
    if args.json:
        doc = {"steps": args.steps, "batch_size": args.batch_size, "hidden": args.hidden,
               "parameters": params, "runs": runs, "mwms_runs": mwms_runs, "ok": not failed}
        if "grpc" in runs and not failed and len(runs) > 1:
            doc["ratio_vs_grpc"] = {
                t: {k: runs[t][k] / runs["grpc"][k] for k in ("examples_per_sec", "steps_per_sec")}
                for t in runs if t != "grpc"}
        print(json.dumps(doc, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
