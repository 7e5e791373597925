"""TF1 between-graph replication with a parameter server, one process per task.

Every task runs this script. Variables (and the optimizer's slots and updates) live on the ps
tasks through `tf.compat.v1.train.replica_device_setter`; each worker builds the same graph,
computes gradients on its own batches and applies them asynchronously on the ps through a
`tf.compat.v1.Session(server.target)`. Worker 0 is the chief: it initializes the variables and
evaluates on a held-out split. A ps task exits by itself once every worker reported done.

    # one shell per task (or use TF_CONFIG instead of --cluster/--job/--task)
    C='ps=127.0.0.1:2222;worker=127.0.0.1:2223,127.0.0.1:2224'
    python examples/tf1_ps_training.py --cluster "$C" --job ps --task 0
    python examples/tf1_ps_training.py --cluster "$C" --job worker --task 0
    python examples/tf1_ps_training.py --cluster "$C" --job worker --task 1

`--transport rdma` swaps `tf.distribute.Server` for `tf_rdma.Server`: every tensor crossing a task
boundary (weights ps->worker, gradients worker->ps) then goes over tf_rdma. Nothing else changes.
All tasks of a cluster must use the same transport.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_utils as cu  # noqa: E402

DONE_QUEUE = "tf1_ps_example_done_{}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=("ps", "worker"), help="this task's job (default: TF_CONFIG)")
    p.add_argument("--task", type=int, help="this task's index (default: TF_CONFIG)")
    p.add_argument("--cluster",
                   help="'ps=host:port[,...];worker=host:port,...' (default: TF_CONFIG)")
    p.add_argument("--transport", choices=cu.TRANSPORTS, default="grpc")
    p.add_argument("--steps", type=int, default=200, help="training steps per worker")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--hidden", default="2048,2048", help="hidden layer widths")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="default 1e-3 for adam, 0.05 for sgd")
    p.add_argument("--eval-every", type=int, default=25, help="chief: evaluate every N steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="first steps left out of the throughput (graph registration)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the other tasks (init, barriers) and per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--events", action="store_true",
                   help="also print machine-readable progress lines (used by demo_cluster.py)")
    p.add_argument("--crash-after-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.hidden = [int(h) for h in args.hidden.split(",") if h]
    if args.learning_rate is None:
        args.learning_rate = 1e-3 if args.optimizer == "adam" else 0.05
    return args


def session_config(tf, job, task, timeout_s=None):
    # device_filters: a worker's session talks only to the ps tasks and itself, so it neither
    # waits for nor depends on the other workers (without it, CreateSession waits for every task
    # in the cluster, and a finished worker would break the others' sessions).
    # operation_timeout_in_ms bounds every step, so a vanished peer becomes an error, not a hang.
    filters = ["/job:ps", f"/job:{job}/task:{task}"]
    config = tf.compat.v1.ConfigProto(device_filters=filters)
    if timeout_s:
        config.operation_timeout_in_ms = int(timeout_s * 1000)
    return config


def build_model(tf, args, cluster_spec, task):
    """The graph every worker builds: the same names in the same order on every worker."""
    num_ps = cluster_spec.num_tasks("ps")
    num_workers = cluster_spec.num_tasks("worker")
    g = {}
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            cluster=cluster_spec, worker_device=f"/job:worker/task:{task}")):
        g["global_step"] = tf.compat.v1.train.get_or_create_global_step()
        g["x"] = x = tf.compat.v1.placeholder(tf.float32, [None, cu.NUM_FEATURES], name="x")
        g["y"] = y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
        h = x
        sizes = [cu.NUM_FEATURES] + args.hidden + [cu.NUM_CLASSES]
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            w = tf.compat.v1.get_variable(
                f"dense{i}/kernel", [n_in, n_out], tf.float32,
                initializer=tf.compat.v1.glorot_uniform_initializer(seed=args.seed + i))
            b = tf.compat.v1.get_variable(f"dense{i}/bias", [n_out], tf.float32,
                                          initializer=tf.compat.v1.zeros_initializer())
            h = tf.matmul(h, w) + b
            if i < len(sizes) - 2:
                h = tf.nn.relu(h)
        g["loss"] = loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        g["accuracy"] = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(h, 1), y), tf.float32))
        if args.optimizer == "adam":
            opt = tf.compat.v1.train.AdamOptimizer(args.learning_rate)
        else:
            opt = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
        # Gradients are computed on this worker; the update ops are colocated with the variables,
        # so they run on the ps.
        g["train_op"] = opt.minimize(loss, global_step=g["global_step"])

        # Barriers between workers: counters on the ps.
        zeros = tf.compat.v1.zeros_initializer()
        ready = tf.compat.v1.get_variable("sync/ready", [], tf.int32, zeros, trainable=False)
        trained = tf.compat.v1.get_variable("sync/trained", [], tf.int32, zeros, trainable=False)
        g["ready"], g["ready_inc"] = ready, tf.compat.v1.assign_add(ready, 1)
        g["trained"], g["trained_inc"] = trained, tf.compat.v1.assign_add(trained, 1)
    g["init"] = tf.compat.v1.global_variables_initializer()
    if task != 0:   # the chief initializes; the others wait until nothing is left uninitialized
        g["uninitialized"] = tf.compat.v1.report_uninitialized_variables()
    # One "done" token per worker into a queue on every ps task: the ps exits once it has them all.
    g["done"] = [done_queue(tf, i, num_workers).enqueue(task) for i in range(num_ps)]
    return g


def done_queue(tf, ps_task, num_workers):
    with tf.compat.v1.device(f"/job:ps/task:{ps_task}"):
        return tf.queue.FIFOQueue(num_workers, tf.int32, shapes=[],
                                  shared_name=DONE_QUEUE.format(ps_task))


def wait_for(sess, tensor, target, what, timeout):
    deadline = time.monotonic() + timeout
    while sess.run(tensor) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def run_ps(tf, args, server, cluster_spec, task):
    num_workers = cluster_spec.num_tasks("worker")
    print(f"ps {task}: serving at {server.target}, waiting for {num_workers} workers", flush=True)
    cu.emit(args.events, kind="serving", job="ps", task=task, pid=os.getpid())
    with tf.Graph().as_default():
        dequeue = done_queue(tf, task, num_workers).dequeue()
        config = tf.compat.v1.ConfigProto(device_filters=[f"/job:ps/task:{task}"])
        with tf.compat.v1.Session(server.target, config=config) as sess:
            for n in range(num_workers):
                worker = sess.run(dequeue)
                print(f"ps {task}: worker {worker} done ({n + 1}/{num_workers})", flush=True)
    # Give the last worker a moment to close its session (it deregisters its graphs on us).
    time.sleep(0.5)
    print(f"ps {task}: all workers done, exiting", flush=True)


def run_worker(tf, np, args, server, cluster_spec, task):
    num_workers = cluster_spec.num_tasks("worker")
    is_chief = task == 0
    x_train, y_train, x_test, y_test = cu.load_digits_split(seed=args.seed)
    n_params = cu.mlp_parameter_count(args.hidden)
    with tf.Graph().as_default():
        g = build_model(tf, args, cluster_spec, task)
        config = session_config(tf, "worker", task, args.timeout)
        with tf.compat.v1.Session(server.target, config=config) as sess:
            t0 = time.monotonic()
            if is_chief:
                sess.run(g["init"])
            else:
                deadline = time.monotonic() + args.timeout
                while len(sess.run(g["uninitialized"])):
                    if time.monotonic() > deadline:
                        raise TimeoutError("timed out waiting for the chief to initialize")
                    time.sleep(0.2)
            sess.run(g["ready_inc"])
            wait_for(sess, g["ready"], num_workers, "all workers to be ready", args.timeout)
            print(f"worker {task}: session ready in {time.monotonic() - t0:.1f} s "
                  f"({n_params / 1e6:.2f} M parameters, {4 * n_params / 2**20:.1f} MiB each way "
                  f"per step)", flush=True)
            cu.emit(args.events, kind="ready", job="worker", task=task, pid=os.getpid())

            def evaluate():
                return sess.run([g["loss"], g["accuracy"]],
                                {g["x"]: x_test, g["y"]: y_test})

            rng = np.random.default_rng(args.seed + 1000 * (task + 1))
            losses, measured_s, measured_steps = [], 0.0, 0
            window_start = None
            for step in range(1, args.steps + 1):
                idx = rng.integers(0, len(x_train), args.batch_size)
                feed = {g["x"]: x_train[idx], g["y"]: y_train[idx]}
                t = time.perf_counter()
                _, loss, gstep = sess.run([g["train_op"], g["loss"], g["global_step"]], feed)
                dt = time.perf_counter() - t
                losses.append(float(loss))
                if step > args.warmup_steps:
                    if window_start is None:
                        window_start = time.time() - dt
                    measured_s += dt
                    measured_steps += 1
                if step == args.crash_after_steps:
                    os._exit(17)
                if step % args.log_every == 0 or step == args.steps:
                    recent = float(np.mean(losses[-args.log_every:]))
                    rate = measured_steps / measured_s if measured_s else 0.0
                    cu.emit(args.events, kind="step", task=task, step=step, global_step=int(gstep),
                            loss=recent, steps_per_sec=rate)
                if is_chief and (step % args.eval_every == 0 or step == args.steps):
                    test_loss, acc = evaluate()
                    recent = float(np.mean(losses[-args.eval_every:]))
                    print(f"worker {task}: step {step}/{args.steps} (global {gstep}) "
                          f"train loss {recent:.4f} test loss {test_loss:.4f} "
                          f"test accuracy {acc:.4f}", flush=True)
                    cu.emit(args.events, kind="eval", task=task, step=step, global_step=int(gstep),
                            train_loss=recent, test_loss=float(test_loss), test_accuracy=float(acc))
            window_end = time.time()
            sess.run(g["trained_inc"])

            result = {
                "kind": "result", "job": "worker", "task": task, "transport": args.transport,
                "steps": args.steps, "batch_size": args.batch_size,
                "measured_steps": measured_steps, "measured_seconds": measured_s,
                "window_start": window_start, "window_end": window_end,
                "steps_per_sec": measured_steps / measured_s if measured_s else 0.0,
                "examples_per_sec":
                    measured_steps * args.batch_size / measured_s if measured_s else 0.0,
                "first_loss": losses[0], "last_loss": losses[-1],
                "loss_first_window": float(np.mean(losses[:args.log_every])),
                "loss_last_window": float(np.mean(losses[-args.log_every:])),
                "parameters": n_params, "bytes_per_step": 2 * 4 * n_params,
            }
            if args.transport == "rdma":
                result["rdma_stats"] = cu.rdma_stats_summary()
            if is_chief:
                wait_for(sess, g["trained"], num_workers, "all workers to finish", args.timeout)
                test_loss, acc = evaluate()
                result.update(final_test_loss=float(test_loss), final_test_accuracy=float(acc),
                              global_step=int(sess.run(g["global_step"])))
                print(f"worker {task}: final test accuracy {acc:.4f} (test loss {test_loss:.4f}, "
                      f"global step {result['global_step']})", flush=True)
            print(f"worker {task}: {result['examples_per_sec']:.0f} examples/s, "
                  f"{result['steps_per_sec']:.2f} steps/s", flush=True)
            cu.emit(args.events, **result)
            sess.run(g["done"])


def main(argv=None):
    args = parse_args(argv)
    cluster, job, task = cu.resolve_task(args.cluster, args.job, args.task)
    make_server = cu.server_class(args.transport)
    import numpy as np
    import tensorflow as tf

    cluster_spec = tf.train.ClusterSpec(cluster)
    # A ps waits for the workers as long as training takes (like server.join()); a worker's steps
    # and barriers are bounded by --timeout.
    config = session_config(tf, job, task, args.timeout if job == "worker" else None)
    server = make_server(cluster_spec, job_name=job, task_index=task, config=config)
    if job == "ps":
        run_ps(tf, args, server, cluster_spec, task)
    elif job == "worker":
        run_worker(tf, np, args, server, cluster_spec, task)
    else:
        raise SystemExit(f"this script runs ps and worker tasks, not {job!r}")


if __name__ == "__main__":
    main()
