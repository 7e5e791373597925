"""TF2 ParameterServerStrategy with Keras `model.fit`, ps and worker tasks in separate processes.

The cluster has ps and worker tasks that only serve (a `tf.distribute.Server` each, or a
`tf_rdma.Server` with `--transport rdma`), and one coordinator (job "chief") that owns the model:
a Keras model compiled with Adam in `strategy.scope()`, so its variables live on the ps tasks.
`model.fit` has the strategy's ClusterCoordinator schedule each training step on whichever worker
is free; the worker reads the weights from the ps, computes gradients and has Adam applied on the
ps, so weights cross ps->worker and gradients worker->ps every step. Data: scikit-learn's digits,
a per-worker tf.data pipeline (a DatasetCreator). With `--transport rdma` the coordinator uses
`tf_rdma.ParameterServerStrategy` (TensorFlow's strategy with tf_rdma loaded in the coordinator too).

    # everything on this host, one process per task (ps, 2 workers, coordinator):
    python examples/tf2_ps_keras.py --launch-local [--transport rdma] [--steps 200]

    # or one command per task, on any hosts (or TF_CONFIG instead of --cluster/--job/--task):
    C='ps=h0:2222;worker=h1:2222,h2:2222;chief=h3:2222'
    python examples/tf2_ps_keras.py --cluster "$C" --job ps --task 0        # serves until killed
    python examples/tf2_ps_keras.py --cluster "$C" --job worker --task 0    # serves until killed
    python examples/tf2_ps_keras.py --cluster "$C" --job worker --task 1
    python examples/tf2_ps_keras.py --cluster "$C" --job chief --task 0     # trains, then exits

With ParameterServerStrategy the scheduled function is partitioned in the worker process (into a
worker part and a ps part), so every ps and worker task must run the same transport. The
coordinator is a client: what it moves itself (creating variables, reading them for evaluation)
stays on gRPC.

Keras 2: Keras 3 (what TensorFlow 2.16+ ships as `keras`) has no ParameterServerStrategy support
in `model.fit` (it fails with "To use this dataset, you need to pass this dataset to
ClusterCoordinator.create_per_worker_dataset"); Keras 2 has. The coordinator imports it as
`tf_keras`: `pip install --no-deps tf-keras==2.21.0`, the version matching TensorFlow (without
--no-deps pip also installs the full `tensorflow` package over `tensorflow-cpu`); ps and worker
tasks need no Keras at all; Keras 3 trains under the strategy in a custom loop
(tf2_keras3_custom_loop.py). Under the strategy, fit takes a DatasetCreator and `steps_per_epoch`; each
fit epoch here is the stretch of steps up to the next evaluation (`--eval-every`), after
`--warmup-steps` untimed ones, and the evaluation runs on the coordinator.
"""
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster_utils as cu  # noqa: E402


def parse_args(argv=None):
    p = cu.launcher_parser(__doc__, "start ps, workers and the coordinator as local processes")
    p.add_argument("--num-workers", type=int, default=2, help="with --launch-local")
    p.add_argument("--num-ps", type=int, default=1, help="with --launch-local")
    p.add_argument("--job", choices=("ps", "worker", "chief"))
    p.add_argument("--task", type=int)
    p.add_argument("--cluster", help="'ps=h:p;worker=h:p,h:p;chief=h:p' (default: TF_CONFIG)")
    p.add_argument("--steps", type=int, default=200, help="training steps over all workers")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", default="2048,2048")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="scheduled and joined before timing starts (tracing, graph registration)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.hidden = [int(h) for h in args.hidden.split(",") if h]
    return args


# ---------------------------------------------------------------------------------------------
# ps and worker tasks: serve until stopped.

def run_server(args, cluster, job, task):
    make_server = cu.server_class(args.transport)
    import tensorflow as tf
    server = make_server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
                         protocol="grpc", start=True)
    print(f"{job} {task}: serving at {server.target} ({args.transport})", flush=True)
    cu.emit(args.events, kind="serving", job=job, task=task, pid=os.getpid())

    def stop(signum, _frame):
        print(f"{job} {task}: stopping on {signal.Signals(signum).name}", flush=True)
        if args.transport == "rdma":
            stats = cu.rdma_stats_summary()
            print(f"{job} {task}: tf_rdma stats {stats}", flush=True)
            cu.emit(args.events, kind="rdma_stats", job=job, task=task, stats=stats)
        # TensorFlow servers cannot be shut down cleanly (GrpcServer::Stop is unimplemented);
        # leave without running destructors.
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:           # server.join() blocks in C++, where no Python signal handler runs
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# The coordinator.

def import_keras2():
    """Keras 2 (the tf-keras package): Keras 3, what TensorFlow 2.16+ ships as `keras`, has no
    ParameterServerStrategy support in model.fit."""
    try:
        import tf_keras
    except ImportError as e:
        import tensorflow as tf
        raise SystemExit(
            f"chief: model.fit under ParameterServerStrategy needs Keras 2: "
            f"pip install --no-deps tf-keras=={tf.__version__} ({e})") from e
    return tf_keras


def build_model(keras, hidden, seed):
    layers = [keras.Input((cu.NUM_FEATURES,))]
    for i, width in enumerate(hidden):
        init = keras.initializers.GlorotUniform(seed + i)
        layers.append(keras.layers.Dense(width, activation="relu", name=f"dense{i}",
                                         kernel_initializer=init))
    layers.append(keras.layers.Dense(cu.NUM_CLASSES, name="logits"))
    return keras.Sequential(layers)


def run_coordinator(args, cluster, task):
    keras = import_keras2()
    import numpy as np
    import tensorflow as tf

    x_train, y_train, x_test, y_test = cu.load_digits_split(seed=args.seed)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=task, rpc_layer="grpc")
    t0 = time.monotonic()
    if args.transport == "rdma":
        import tf_rdma
        # TensorFlow's strategy, with tf_rdma loaded in this process too, so that whatever the
        # coordinator partitions itself is rewritten the same way as on the workers.
        strategy = tf_rdma.ParameterServerStrategy(resolver)
    else:
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    with strategy.scope():     # variables (the model's and Adam's) are created on the ps tasks
        model = build_model(keras, args.hidden, args.seed)
        optimizer = keras.optimizers.Adam(args.learning_rate)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        optimizer.build(model.trainable_variables)
    n_params = model.count_params()
    devices = sorted({v.device for v in model.weights + optimizer.variables})
    print(f"chief: {len(cluster['worker'])} workers and {len(cluster['ps'])} ps in "
          f"{time.monotonic() - t0:.1f} s; {n_params / 1e6:.2f} M parameters; variables on "
          f"{devices}", flush=True)
    cu.emit(args.events, kind="ready", job="chief", task=task, pid=os.getpid())

    def dataset_fn(_input_context):
        # Called in every worker: each builds its own input pipeline.
        ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        return ds.shuffle(len(x_train), seed=args.seed).repeat().batch(
            args.batch_size, drop_remainder=True).prefetch(2)

    # model.fit under ParameterServerStrategy: ClusterCoordinator schedules each step on whichever
    # worker is free; the worker reads the weights from the ps, computes the gradients and has
    # Adam apply them on the ps. Fit needs a DatasetCreator (or a dataset function) and
    # steps_per_epoch; each "epoch" here is the stretch of steps up to the next evaluation.
    data = keras.utils.experimental.DatasetCreator(dataset_fn)
    epoch = 0

    def run_steps(n):
        """n steps as one epoch of model.fit; the mean training loss over them."""
        nonlocal epoch
        history = model.fit(data, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=n,
                            verbose=0)
        epoch += 1
        return float(history.history["loss"][-1])

    def evaluate():
        # Runs on the coordinator, reading the weights from the ps.
        logits = model(x_test, training=False)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_test, logits=logits))
        return float(loss), float(np.mean(np.argmax(logits, axis=1) == y_test))

    warm = min(args.warmup_steps, args.steps)
    chunks = []           # (steps, mean training loss) per model.fit epoch
    if warm:
        chunks.append((warm, run_steps(warm)))
    train_s, done = 0.0, warm
    while done < args.steps:
        n = min(args.eval_every - done % args.eval_every, args.steps - done)
        t = time.perf_counter()
        chunks.append((n, run_steps(n)))
        train_s += time.perf_counter() - t
        done += n
        if done % args.eval_every == 0 or done == args.steps:
            test_loss, acc = evaluate()
            recent = chunks[-1][1]
            print(f"chief: step {done}/{args.steps} train loss {recent:.4f} "
                  f"test loss {test_loss:.4f} test accuracy {acc:.4f}", flush=True)
            cu.emit(args.events, kind="eval", step=done, train_loss=recent,
                    test_loss=test_loss, test_accuracy=acc)
    test_loss, acc = evaluate()
    measured = args.steps - warm
    result = {
        "kind": "result", "job": "chief", "transport": args.transport, "steps": args.steps,
        "batch_size": args.batch_size, "measured_steps": measured, "measured_seconds": train_s,
        "steps_per_sec": measured / train_s if train_s else 0.0,
        "examples_per_sec": measured * args.batch_size / train_s if train_s else 0.0,
        # Mean training losses of the first model.fit epoch (the warm-up steps, if any) and of
        # the last one.
        "first_loss": chunks[0][1], "last_loss": chunks[-1][1],
        "loss_first_window": chunks[0][1], "loss_last_window": chunks[-1][1],
        "epoch_losses": [loss for _, loss in chunks], "epoch_steps": [n for n, _ in chunks],
        "final_test_loss": test_loss, "final_test_accuracy": acc, "parameters": n_params,
        "optimizer_iterations": int(optimizer.iterations.numpy()),
        "keras": keras.__version__,
    }
    print(f"chief: done: {result['examples_per_sec']:.0f} examples/s, "
          f"{result['steps_per_sec']:.2f} steps/s, final test accuracy {acc:.4f}", flush=True)
    cu.emit(args.events, **result)
    return result


# ---------------------------------------------------------------------------------------------
# --launch-local: the whole cluster as local processes.

def launch_local(args):
    import shutil
    import tempfile

    cu.raise_on_termination_signals()
    out = sys.stderr if args.json else sys.stdout
    cluster = cu.local_cluster(args.num_ps, args.num_workers, extra_jobs=[("chief", 1)],
                               transport=args.transport)
    spec = cu.format_cluster(cluster)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_rdma_tf2_")
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    common = ["--cluster", spec, "--transport", args.transport, "--events",
              "--steps", args.steps, "--batch-size", args.batch_size,
              "--hidden", ",".join(map(str, args.hidden)), "--learning-rate", args.learning_rate,
              "--eval-every", args.eval_every, "--warmup-steps", args.warmup_steps,
              "--seed", args.seed]
    results, pids, rdma_stats = {}, {}, {}

    def on_event(name, ev):
        kind = ev.get("kind")
        if kind in ("serving", "ready"):
            pids[name] = ev.get("pid")
            print(f"[{args.transport}] {name} {kind} (pid {ev.get('pid')})", file=out, flush=True)
        elif kind == "eval":
            print(f"[{args.transport}] step {ev['step']:4d}/{args.steps}  train loss "
                  f"{ev['train_loss']:.4f}  test acc {ev['test_accuracy']:.4f}", file=out,
                  flush=True)
        elif kind == "result":
            results[name] = ev

    ok = False
    t0 = time.monotonic()
    try:
        with cu.reporting_stops():
            print(f"[{args.transport}] cluster {spec}", file=out, flush=True)
            with cu.LocalCluster(log_dir, env) as lc:
                for job in ("ps", "worker"):
                    for i in range(len(cluster[job])):
                        lc.start(f"{job}{i}", cu.python_argv(__file__, "--job", job, "--task", i,
                                                             *common), daemon=True)
                        pids[f"{job}{i}"] = lc.pid(f"{job}{i}")
                lc.start("chief", cu.python_argv(__file__, "--job", "chief", "--task", 0, *common))
                pids["chief"] = lc.pid("chief")
                lc.wait(until=["chief"], timeout=args.timeout, stall_timeout=180, on_event=on_event)
            for name, ev in lc.drain():       # the servers' tf_rdma stats, printed as they stopped
                if ev.get("kind") == "rdma_stats" and ev.get("stats"):
                    st = ev["stats"]
                    rdma_stats[name] = st
                    print(f"[{args.transport}] {name}: tf_rdma carried {st['tensors_sent']} tensors "
                          f"({st['bytes_sent'] / 2**20:.0f} MiB) out, {st['tensors_received']} "
                          f"({st['bytes_received'] / 2**20:.0f} MiB) in, backend "
                          f"{'/'.join(st['backends']) or '-'}", file=out, flush=True)
            ok = "chief" in results
            if not ok:
                print("FAILED: the coordinator exited without a result", file=out)
    except cu.ClusterFailed as e:
        print(f"[{args.transport}] FAILED: {e}", file=out, flush=True)
    finally:
        if not ok:
            print(f"logs kept in {log_dir}", file=out)
        elif not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    wall = time.monotonic() - t0
    if ok:
        r = results["chief"]
        print(f"[{args.transport}] done in {wall:.1f} s: {r['examples_per_sec']:.0f} examples/s, "
              f"{r['steps_per_sec']:.2f} steps/s, loss {r['loss_first_window']:.3f} -> "
              f"{r['loss_last_window']:.3f}, final test accuracy {r['final_test_accuracy']:.4f}",
              file=out, flush=True)
    return cu.launch_outcome(args, ok, wall_seconds=wall, cluster=cluster, pids=pids,
                             result=results.get("chief"), rdma_stats=rdma_stats)


def main(argv=None):
    args = parse_args(argv)
    if args.launch_local:
        return launch_local(args)
    cluster, job, task = cu.resolve_task(args.cluster, args.job, args.task)
    if job in ("ps", "worker"):
        run_server(args, cluster, job, task)
    elif job == "chief":
        run_coordinator(args, cluster, task)
        # The coordinator's threads keep RPCs to the workers open; leave without tearing them down.
        sys.stdout.flush()
        os._exit(0)
    else:
        raise SystemExit(f"unknown job {job!r}: expected ps, worker or chief")
    return 0


if __name__ == "__main__":
    sys.exit(main())
