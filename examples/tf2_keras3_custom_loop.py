"""Keras 3 (TensorFlow's default `keras`) in custom training loops, under MultiWorkerMirroredStrategy
or ParameterServerStrategy, one process per task.

Keras 3's `model.fit` supports neither strategy across processes (keras-team/keras#20585), on
TensorFlow's gRPC as on tf_rdma; its layers, models, losses and optimizers work in a custom loop:
  --strategy mwms  every worker holds the model (the MLP of the other examples) and runs each step
                   with `strategy.run` on its share of the global batch; Keras 3's optimizer
                   all-reduces the gradients across the workers in `apply_gradients`.
  --strategy ps    the coordinator (job "chief") creates the model and the optimizer in the
                   strategy's scope, so their variables live on the ps; `ClusterCoordinator.schedule`
                   runs each step on a worker, which reads the weights from the ps and has the
                   optimizer's update applied there. ps and worker tasks only serve.
`--transport grpc` uses TensorFlow's strategies (and `tf.distribute.Server`), `--transport rdma`
tf_rdma's (`tf_rdma.MultiWorkerMirroredStrategy`, `tf_rdma.ParameterServerStrategy`,
`tf_rdma.Server`), with the same arguments; nothing else differs.

    python examples/tf2_keras3_custom_loop.py --launch-local --strategy mwms [--transport rdma]
    python examples/tf2_keras3_custom_loop.py --launch-local --strategy ps [--transport rdma]

    # or one command per task, TF_CONFIG naming it: workers (mwms); ps, workers and a chief (ps)
    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' \\
        python examples/tf2_keras3_custom_loop.py --strategy mwms

Deterministic: seeded initializers, a seeded shuffle and a fixed sharding of each batch; with ps, one
worker (the default) runs the steps in order (with more, which worker takes which step is
TensorFlow's choice). `--save PATH` writes the trainer's final weights and per-step losses (.npz)
to compare runs bit for bit (the tests compare mwms over tf_rdma with gRPC, ps over tcp with shm).
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster_utils as cu  # noqa: E402
from tf2_ps_keras import build_model  # noqa: E402  (the MLP of the other examples)

WORKERS_BY_DEFAULT = {"mwms": 2, "ps": 1}


def parse_args(argv=None):
    p = cu.launcher_parser(__doc__, "start every task as a local process (otherwise: run the task "
                                    "TF_CONFIG names)")
    p.add_argument("--strategy", choices=sorted(WORKERS_BY_DEFAULT), required=True)
    p.add_argument("--num-workers", type=int, help="with --launch-local (default: mwms 2, ps 1)")
    p.add_argument("--steps", type=int, default=50, help="training steps")
    p.add_argument("--batch-size", type=int, default=64, help="per worker and step")
    p.add_argument("--hidden", default="2048,2048")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="the trainer (mwms: worker 0; ps: the chief) writes its final "
                                  "weights and per-step losses here (.npz)")
    args = p.parse_args(argv)
    args.hidden = [int(h) for h in args.hidden.split(",") if h]
    if args.num_workers is None:
        args.num_workers = WORKERS_BY_DEFAULT[args.strategy]
    if args.steps < 1 or args.num_workers < 1:
        p.error("--steps and --num-workers must be at least 1")
    return args


def import_keras3():
    import keras
    if not keras.__version__.startswith("3."):
        raise SystemExit(f"this example shows Keras 3, and `keras` here is {keras.__version__}")
    return keras


def shuffled_batches(x, y, batch_size, seed):
    """The same endless stream of batches in every run: a seeded shuffle, whole batches only."""
    import tensorflow as tf
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    return ds.shuffle(len(x), seed=seed).repeat().batch(batch_size, drop_remainder=True)


def mirrored_batches(x, y, global_batch, seed):
    """shuffled_batches of the global batch, sharded by DATA: each worker takes a fixed slice of
    every batch (MultiWorkerMirroredStrategy's experimental_distribute_dataset)."""
    import tensorflow as tf
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    return shuffled_batches(x, y, global_batch, seed).with_options(options)


def mirrored_train_step(strategy, model, optimizer, loss_fn, global_batch):
    """A MultiWorkerMirroredStrategy step over a distributed iterator: each replica's share of the
    global batch; the optimizer all-reduces the gradients. Returns the global batch's mean loss.
    `loss_fn` must return per-example losses (reduction "none"), in Keras 2 as in Keras 3."""
    import tensorflow as tf

    @tf.function
    def train_step(iterator):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = loss_fn(y, model(x, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        per_replica = strategy.run(replica_step, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    return train_step


def test_accuracy(model, x_test, y_test):
    import numpy as np
    return float(np.mean(np.argmax(model(x_test, training=False), axis=1) == y_test))


def finish(args, keras, job, index, model, optimizer, losses, seconds, accuracy):
    """The trainer's result event (and its --save file)."""
    import numpy as np
    result = {
        "kind": "result", "job": job, "task": index, "strategy": args.strategy,
        "transport": args.transport, "keras": keras.__version__,
        "steps": args.steps, "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
        "final_test_accuracy": accuracy, "optimizer_iterations": int(optimizer.iterations.numpy()),
        "seconds": seconds, "parameters": model.count_params(),
    }
    if args.transport == "rdma":
        result["rdma_stats"] = cu.rdma_stats_summary()
    if args.save:
        weights = {f"weight{i}": w for i, w in enumerate(model.get_weights())}
        np.savez(args.save, losses=np.asarray(losses, np.float64), **weights)
    print(f"{job} {index}: {args.steps} steps in {seconds:.1f} s, loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}, test accuracy {accuracy:.4f}", flush=True)
    cu.emit(args.events, **result)


# ---------------------------------------------------------------------------------------------
# --strategy mwms: every worker trains.

def run_mirrored_worker(args, cluster, index):
    keras = import_keras3()
    import tensorflow as tf

    keras.utils.set_random_seed(args.seed)     # the output layer's initializer draws from it
    if args.transport == "rdma":
        import tf_rdma
        strategy = tf_rdma.MultiWorkerMirroredStrategy()      # reads TF_CONFIG, starts the server
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    x_train, y_train, x_test, y_test = cu.load_digits_split(seed=args.seed)
    iterator = iter(strategy.experimental_distribute_dataset(
        mirrored_batches(x_train, y_train, global_batch, args.seed)))
    with strategy.scope():
        model = build_model(keras, args.hidden, args.seed)
        optimizer = keras.optimizers.Adam(args.learning_rate)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    train_step = mirrored_train_step(strategy, model, optimizer, loss_fn, global_batch)
    cu.emit(args.events, kind="ready", job="worker", task=index, pid=os.getpid())

    started = time.perf_counter()
    losses = [float(train_step(iterator)) for _ in range(args.steps)]
    seconds = time.perf_counter() - started
    # Mirrored: every worker holds the same weights, so each evaluates on its own.
    finish(args, keras, "worker", index, model, optimizer, losses, seconds,
           test_accuracy(model, x_test, y_test))


# ---------------------------------------------------------------------------------------------
# --strategy ps: the coordinator trains, ps and worker tasks serve.

def run_coordinator(args, cluster, index):
    keras = import_keras3()
    import tensorflow as tf

    keras.utils.set_random_seed(args.seed)     # the output layer's initializer draws from it
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=index, rpc_layer="grpc")
    if args.transport == "rdma":
        import tf_rdma
        strategy = tf_rdma.ParameterServerStrategy(resolver)
    else:
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():       # the model's and the optimizer's variables go to the ps
        model = build_model(keras, args.hidden, args.seed)
        optimizer = keras.optimizers.Adam(args.learning_rate)
        optimizer.build(model.trainable_variables)
    x_train, y_train, x_test, y_test = cu.load_digits_split(seed=args.seed)
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: shuffled_batches(x_train, y_train, args.batch_size, args.seed)))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(iterator):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica_step, args=next(iterator))
    cu.emit(args.events, kind="ready", job="chief", task=index, pid=os.getpid())

    started = time.perf_counter()
    scheduled = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(args.steps)]
    coordinator.join()
    seconds = time.perf_counter() - started
    losses = [float(step.fetch()) for step in scheduled]
    # The coordinator evaluates, reading the weights from the ps.
    finish(args, keras, "chief", index, model, optimizer, losses, seconds,
           test_accuracy(model, x_test, y_test))


# ---------------------------------------------------------------------------------------------
# --launch-local: the whole cluster as local processes.

def launch_local(args):
    out = sys.stderr if args.json else sys.stdout
    if args.strategy == "mwms":
        # MultiWorkerMirroredStrategy's cluster has workers only.
        cluster = {"worker": cu.local_cluster(0, args.num_workers, transport=args.transport)["worker"]}
        servers, trainer = [], "worker0"
        tasks = [(f"worker{i}", "worker", i) for i in range(args.num_workers)]
    else:
        cluster = cu.local_cluster(1, args.num_workers, extra_jobs=[("chief", 1)], transport=args.transport)
        servers = [("ps0", "ps", 0)] + [(f"worker{i}", "worker", i) for i in range(args.num_workers)]
        tasks, trainer = [("chief", "chief", 0)], "chief"
    argv = ["--strategy", args.strategy, "--transport", args.transport, "--steps", args.steps,
            "--batch-size", args.batch_size, "--hidden", ",".join(map(str, args.hidden)),
            "--learning-rate", args.learning_rate, "--seed", args.seed, "--events"]
    results, pids = {}, {}

    def on_event(name, ev):
        if ev.get("kind") in ("serving", "ready"):
            pids[name] = ev.get("pid")
        elif ev.get("kind") == "result":
            results[name] = ev

    def start(lc):
        print(f"[{args.transport}] {args.strategy}: {cluster}", file=out, flush=True)
        for name, job, index in servers + tasks:
            save = ["--save", os.path.abspath(args.save)] if args.save and name == trainer else []
            lc.start(name, cu.python_argv(__file__, *argv, *save), daemon=(name, job, index) in servers,
                     env={"TF_CONFIG": cu.tf_config(cluster, job, index)})
            pids[name] = lc.pid(name)

    t0 = time.monotonic()
    names = [name for name, _, _ in tasks]
    left = cu.run_local_cluster(
        args.transport, start, names, on_event, timeout=args.timeout, log_dir=args.log_dir,
        log_prefix=f"tf_rdma_keras3_{args.strategy}_", out=out,
        missing=lambda: set(names) != set(results) and f"no result from {sorted(set(names) - set(results))}")
    rdma_stats = {name: ev.get("rdma_stats") for name, ev in results.items()}
    # The serving tasks report what tf_rdma carried as they stop.
    rdma_stats.update({name: ev["stats"] for name, ev in left or () if ev.get("kind") == "rdma_stats"})
    if left is not None:
        r = results[trainer]
        print(f"[{args.transport}] {args.strategy} with Keras {r['keras']}: loss {r['first_loss']:.3f} -> "
              f"{r['last_loss']:.3f}, test accuracy {r['final_test_accuracy']:.4f}", file=out, flush=True)
    return cu.launch_outcome(args, left is not None, wall_seconds=time.monotonic() - t0, cluster=cluster,
                             pids=pids, result=results.get(trainer), rdma_stats=rdma_stats)


def main(argv=None):
    args = parse_args(argv)
    launched = cu.launch_locally_or_require_tf_config(args, launch_local)
    if launched is not None:
        return launched
    cluster, job, index = cu.resolve_task(None, None, None)
    if args.strategy == "mwms":
        run_mirrored_worker(args, cluster, index)
    elif job == "chief":
        run_coordinator(args, cluster, index)
    else:
        cu.serve_until_stopped(args.transport, cluster, job, index, args.events)
    sys.stdout.flush()
    # A TensorFlow server cannot be shut down (GrpcServer::Stop is unimplemented), and the
    # strategies' threads would keep the interpreter from exiting.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
