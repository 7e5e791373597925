"""TF2 MultiWorkerMirroredStrategy, one process per worker: Keras `model.fit` or a custom loop.

Every worker holds a full copy of the model (a Keras MLP, the same as tf2_ps_keras.py's) and
trains on its share of each global batch of scikit-learn's digits; after every step the workers
all-reduce their gradients (collective ops, ring all-reduce), so each step moves the whole
gradient (16.6 MiB for the default 4.35 M parameters) between the workers. There is no ps and no
coordinator: each worker runs this script with its TF_CONFIG, and the strategy starts the task's
server itself. `--transport grpc` uses `tf.distribute.MultiWorkerMirroredStrategy`, `--transport
rdma` `tf_rdma.MultiWorkerMirroredStrategy` (same arguments); nothing else differs.

    # everything on this host, one process per worker:
    python examples/tf2_mwms_keras.py --launch-local [--transport rdma] [--loop custom] [--steps 100]

    # or one command per worker, on any hosts:
    TF_CONFIG='{"cluster": {"worker": ["h1:2222", "h2:2222"]}, "task": {"type": "worker", "index": 0}}' \\
        python examples/tf2_mwms_keras.py
    TF_CONFIG='{... "task": {"type": "worker", "index": 1}}' python examples/tf2_mwms_keras.py

Deterministic: fixed initializer seeds, a seeded shuffle and a fixed sharding of each batch, so two
runs (over either transport) give bit-identical weights; `--save PATH` writes worker 0's final
weights and per-step losses to an .npz. Keras 2 (`tf_keras`, `pip install --no-deps
tf-keras==2.21.0`), as in tf2_ps_keras.py: Keras 3's `model.fit` does not support more than one
worker; its custom loop is in tf2_keras3_custom_loop.py.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster_utils as cu  # noqa: E402
from tf2_keras3_custom_loop import mirrored_batches, mirrored_train_step  # noqa: E402  (as in Keras 3)
from tf2_ps_keras import build_model  # noqa: E402  (the same MLP as the PS example)


def parse_args(argv=None):
    p = cu.launcher_parser(__doc__, "start every worker as a local process (otherwise: run the task "
                                    "TF_CONFIG names)")
    p.add_argument("--num-workers", type=int, default=2, help="with --launch-local")
    p.add_argument("--loop", choices=("fit", "custom"), default="fit",
                   help="Keras model.fit, or a custom loop (strategy.run + GradientTape)")
    p.add_argument("--steps", type=int, default=100, help="training steps (every worker runs each)")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="run before timing starts (tracing, collective group setup)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--hidden", default="2048,2048")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="worker 0 writes its final weights and per-step losses here (.npz)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="each worker writes TensorBoard logs to DIR/workerN: with --transport rdma, "
                        "tf_rdma's per-peer traffic as scalars every 10 steps (tf_rdma.keras.StatsCallback); "
                        "with --loop fit, a profile of the first two timed steps (Keras' TensorBoard "
                        "callback: tf_rdma's transfers appear in its trace viewer)")
    args = p.parse_args(argv)
    args.hidden = [int(h) for h in args.hidden.split(",") if h]
    if args.warmup_steps >= args.steps:
        p.error("--steps must be larger than --warmup-steps")
    return args


def import_keras2():
    try:
        import tf_keras
    except ImportError as e:
        import tensorflow as tf
        raise SystemExit(f"this example uses Keras 2: pip install --no-deps "
                         f"tf-keras=={tf.__version__} ({e})") from e
    return tf_keras


def make_strategy(transport):
    """The only line that differs between the transports. Both read TF_CONFIG and start this
    task's server themselves."""
    import tensorflow as tf
    if transport == "rdma":
        import tf_rdma
        return tf_rdma.MultiWorkerMirroredStrategy()
    return tf.distribute.MultiWorkerMirroredStrategy()


# ---------------------------------------------------------------------------------------------
# One worker (the task TF_CONFIG names).

def run_worker(args):
    keras = import_keras2()
    import numpy as np

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    index = int(task["index"])
    keras.utils.set_random_seed(args.seed)
    strategy = make_strategy(args.transport)
    workers = strategy.num_replicas_in_sync
    global_batch = args.batch_size * workers
    x_train, y_train, x_test, y_test = cu.load_digits_split(seed=args.seed)

    def dataset():
        # The same pipeline in every worker, each taking a fixed slice of every global batch.
        return mirrored_batches(x_train, y_train, global_batch, args.seed)

    with strategy.scope():
        model = build_model(keras, args.hidden, args.seed)
        optimizer = keras.optimizers.Adam(args.learning_rate)
    n_params = model.count_params()
    print(f"worker {index}: {workers} workers, {n_params / 1e6:.2f} M parameters "
          f"({4 * n_params / 2**20:.1f} MiB all-reduced per step), loop {args.loop}", flush=True)
    cu.emit(args.events, kind="ready", job="worker", task=index, pid=os.getpid())

    stats_callback = None
    if args.tensorboard and args.transport == "rdma":
        import tf_rdma.keras
        stats_callback = tf_rdma.keras.StatsCallback(os.path.join(args.tensorboard, f"worker{index}"),
                                                     every_n_steps=10)

    losses = []
    if args.loop == "fit":
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = dataset()

        class StepLosses(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                losses.append(logs["loss"])   # Keras 2: the epoch's running mean so far

        def run_steps(n, epoch, profiled=False):
            callbacks = [StepLosses(), *([stats_callback] if stats_callback else [])]
            if profiled and args.tensorboard:
                callbacks.append(keras.callbacks.TensorBoard(os.path.join(args.tensorboard, f"worker{index}"),
                                                             profile_batch=(1, 2)))
            model.fit(data, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=n, verbose=0,
                      callbacks=callbacks)
        run_steps(args.warmup_steps, 0)
        t = time.perf_counter()
        run_steps(args.steps - args.warmup_steps, 1, profiled=True)
        seconds = time.perf_counter() - t
    else:
        iterator = iter(strategy.experimental_distribute_dataset(dataset()))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        train_step = mirrored_train_step(strategy, model, optimizer, loss_fn, global_batch)

        def run_step():
            losses.append(float(train_step(iterator)))
            if stats_callback and len(losses) % stats_callback.every_n_steps == 0:
                stats_callback.write(len(losses))

        for _ in range(args.warmup_steps):
            run_step()
        t = time.perf_counter()
        for _ in range(args.steps - args.warmup_steps):
            run_step()
        seconds = time.perf_counter() - t

    # The weights are the same on every worker (mirrored): evaluate locally, no collective.
    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    measured = args.steps - args.warmup_steps
    result = {
        "kind": "result", "job": "worker", "task": index, "transport": args.transport,
        "loop": args.loop, "workers": workers, "steps": args.steps, "batch_size": args.batch_size,
        "global_batch_size": global_batch, "measured_steps": measured, "measured_seconds": seconds,
        "steps_per_sec": measured / seconds,
        "examples_per_sec": measured * global_batch / seconds,
        "first_loss": losses[0], "last_loss": losses[-1],
        "final_test_accuracy": accuracy, "parameters": n_params,
        "bytes_allreduced_per_step": 4 * n_params,
        "optimizer_iterations": int(optimizer.iterations.numpy()),
    }
    if args.transport == "rdma":
        result["rdma_stats"] = cu.rdma_stats_summary()
    if args.save and index == 0:
        weights = {f"weight{i}": w for i, w in enumerate(model.get_weights())}
        np.savez(args.save, losses=np.asarray(losses, np.float64), **weights)
    print(f"worker {index}: {result['examples_per_sec']:.0f} examples/s "
          f"({result['steps_per_sec']:.2f} steps/s), loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"test accuracy {accuracy:.4f}", flush=True)
    cu.emit(args.events, **result)
    return result


# ---------------------------------------------------------------------------------------------
# --launch-local: every worker as a local process.

def run_local(args, out):
    """Runs every worker as a local process; returns the run's summary ("ok", "result": worker
    0's result event, "results", "rdma_stats" per worker, "wall_seconds", ...)."""
    # MultiWorkerMirroredStrategy's cluster has only workers (an empty "ps" job would be a job
    # without tasks).
    cluster = {"worker": cu.local_cluster(0, args.num_workers, transport=args.transport)["worker"]}
    argv = ["--transport", args.transport, "--loop", args.loop, "--steps", args.steps,
            "--warmup-steps", args.warmup_steps, "--batch-size", args.batch_size,
            "--hidden", ",".join(map(str, args.hidden)), "--learning-rate", args.learning_rate,
            "--seed", args.seed, "--events"]
    if args.tensorboard:
        argv += ["--tensorboard", os.path.abspath(args.tensorboard)]
    if args.save:
        argv += ["--save", os.path.abspath(args.save)]
    names = [f"worker{i}" for i in range(args.num_workers)]
    results, pids = {}, {}

    def on_event(name, ev):
        if ev.get("kind") == "ready":
            pids[name] = ev.get("pid")
            print(f"[{args.transport}] {name} ready (pid {ev.get('pid')})", file=out, flush=True)
        elif ev.get("kind") == "result":
            results[name] = ev

    def start(lc):
        print(f"[{args.transport}] {args.num_workers} workers: {cluster['worker']}", file=out,
              flush=True)
        for i, name in enumerate(names):
            lc.start(name, cu.python_argv(__file__, *argv),
                     env={"TF_CONFIG": cu.tf_config(cluster, "worker", i)})
            pids[name] = lc.pid(name)

    t0 = time.monotonic()
    ok = cu.run_local_cluster(
        args.transport, start, names, on_event, timeout=args.timeout, log_dir=args.log_dir,
        log_prefix="tf_rdma_mwms_", out=out, stall_timeout=300,
        missing=lambda: set(names) != set(results) and f"no result from "
                                                       f"{sorted(set(names) - set(results))}"
    ) is not None
    wall = time.monotonic() - t0
    if ok:
        r = results["worker0"]
        print(f"[{args.transport}] done in {wall:.1f} s ({args.loop}): "
              f"{r['examples_per_sec']:.0f} examples/s, {r['steps_per_sec']:.2f} steps/s, "
              f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, final test accuracy "
              f"{r['final_test_accuracy']:.4f}", file=out, flush=True)
        for name in names:
            st = results[name].get("rdma_stats")
            if st:
                print(f"[{args.transport}] {name}: tf_rdma carried {st['bytes_sent'] / 2**20:.0f} "
                      f"MiB out, {st['bytes_received'] / 2**20:.0f} MiB in", file=out, flush=True)
    return {"ok": ok, "wall_seconds": wall, "cluster": cluster, "pids": pids,
            "result": results.get("worker0"), "results": results,
            "rdma_stats": {n: r.get("rdma_stats") for n, r in results.items()}}


def launch_local(args):
    summary = run_local(args, sys.stderr if args.json else sys.stdout)
    return cu.launch_outcome(args, **summary)


def main(argv=None):
    args = parse_args(argv)
    launched = cu.launch_locally_or_require_tf_config(args, launch_local)
    if launched is not None:
        return launched
    run_worker(args)
    sys.stdout.flush()
    # The strategy's server cannot be shut down (GrpcServer::Stop is unimplemented) and its
    # threads would keep the interpreter from exiting.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
