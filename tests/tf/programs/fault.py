"""Coordinator programs for test_fault_tolerance.py: `python fault.py FUNCTION JSON_ARGS`,
as tasks.py. A ClusterCoordinator trains a variable on the ps, step after step, while the test
kills and restarts tasks; each program records what TensorFlow's fault tolerance made of it."""
import json
import os
import sys
import time

from tests.tf.programs.tasks import ps_strategy


def _training(cluster, transport):
    """The coordinator, and a step that reads and updates the ps's variable and counts itself there."""
    import tensorflow as tf
    strategy = ps_strategy(cluster, transport)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        weights = tf.Variable(tf.ones((256, 256)))
        iterations = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        def replica():
            value = tf.reduce_sum(tf.matmul(weights, weights))
            weights.assign_add(tf.ones((256, 256)) * 1e-6)
            iterations.assign_add(1)
            return value
        return strategy.run(replica)

    return coordinator, step, iterations


def _write(output, outcome):
    with open(output, "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the coordinator's threads keep polling the cluster otherwise


def _failure(error, where):
    return {"error": type(error).__name__, "message": str(error)[:2000], "where": where,
            "failed_at": time.time()}


def until_ps_failure(cluster, job, index, transport, output, during):
    """Trains until the test kills the ps, which it does after "warm" ("schedule": the coordinator
    keeps scheduling without joining) or after "joining" (the coordinator waits in join on a long
    queue). Records what raised, where, and when."""
    coordinator, step, _ = _training(cluster, transport)
    coordinator.schedule(step)
    coordinator.join()
    print("warm", flush=True)
    deadline = time.monotonic() + 180
    outcome = {}
    where = during
    try:
        if during == "schedule":
            while time.monotonic() < deadline:
                coordinator.schedule(step)
        else:
            for _ in range(2000):
                coordinator.schedule(step)
            print("joining", flush=True)
            coordinator.join()
            where = "nowhere: join returned"
    except Exception as e:  # the outcome under test, whatever its class
        outcome = _failure(e, where)
    _write(output, outcome)


def through_worker_restart(cluster, job, index, transport, output, steps=300):
    """Schedules `steps` steps after "warm" and joins while the test kills the worker and starts it
    again: TensorFlow retries the steps the dead worker lost, so all of them run."""
    coordinator, step, iterations = _training(cluster, transport)
    for _ in range(10):
        coordinator.schedule(step)
    coordinator.join()
    print("warm", flush=True)
    started = time.monotonic()
    try:
        for _ in range(steps):
            coordinator.schedule(step)
        coordinator.join()
        outcome = {"iterations": int(iterations.numpy()), "seconds": time.monotonic() - started}
    except Exception as e:  # the outcome under test, whatever its class
        outcome = _failure(e, "join")
    _write(output, outcome)


def trains_again(cluster, job, index, transport, output, steps=20):
    """A new coordinator on a cluster whose ps was restarted: creates its variables and trains."""
    coordinator, step, iterations = _training(cluster, transport)
    for _ in range(steps):
        coordinator.schedule(step)
    coordinator.join()
    _write(output, {"iterations": int(iterations.numpy())})


def copies_past_a_frozen_worker(cluster, job, index, transport, output):
    """Eager copies from this coordinator: to worker 0 while the test keeps it frozen past the peer
    timeout (over tf_rdma the copy's eager call fails when the connection ends), then to worker 1,
    which must arrive: one peer's failure must not stop the coordinator's transfers to the others
    (its eager rendezvous outlives every step). Then to worker 0 again, thawed."""
    import threading
    import tensorflow as tf
    ps_strategy(cluster, transport)  # connects this process to the cluster

    def copy_to(task):
        # A new tensor each time (TensorFlow keeps a tensor's copy on a worker and would send it
        # once), of 1 MiB: it travels apart from its header, into the receiver's grant.
        x = tf.ones((1 << 18,))
        with tf.device(f"/job:worker/replica:0/task:{task}/device:CPU:0"):
            return float(tf.reduce_sum(tf.identity(x)).numpy())

    outcome = {"before": [copy_to(0), copy_to(1)]}
    print("warm", flush=True)
    sys.stdin.readline()  # worker 0 is frozen now
    to_frozen = {}

    def copy_to_frozen():
        try:
            to_frozen["sum"] = copy_to(0)
        except Exception as e:  # the outcome under test, whatever its class
            to_frozen["error"] = type(e).__name__
            to_frozen["message"] = str(e)[:2000]
    copying = threading.Thread(target=copy_to_frozen, daemon=True)
    copying.start()
    print("copying", flush=True)
    sys.stdin.readline()  # worker 0 resumed, after more than the peer timeout
    started = time.monotonic()
    outcome["after"] = copy_to(1)
    outcome["after_seconds"] = time.monotonic() - started
    # The copy to the thawed worker ends, with its sum or an error, or the bound says it hung.
    copying.join(timeout=90)
    outcome["to_frozen"] = dict(to_frozen, seconds=time.monotonic() - started)
    # The thawed worker takes copies again.
    started = time.monotonic()
    try:
        outcome["again"] = copy_to(0)
    except Exception as e:  # the outcome under test, whatever its class
        outcome["again"] = f"{type(e).__name__}: {str(e)[:2000]}"
    outcome["again_seconds"] = time.monotonic() - started
    _write(output, outcome)


def through_worker_faults(cluster, job, index, transport, output, queued=100):
    """Trains while the test partitions a worker or freezes it. Never joins while it trains (a join
    waits for the faulted worker's step): every 0.1 s tops the steps scheduled and not yet done
    (counted on the ps) up to `queued`, so no worker ever waits for a step, and prints, as
    "progress JSON", the steps scheduled and each worker's done (TensorFlow's worker index tells
    which worker ran a step). A line on stdin ends it: joins, and writes the steps scheduled and
    counted, and tf_rdma's stats."""
    import threading
    import tensorflow as tf
    strategy = ps_strategy(cluster, transport)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    workers = len(cluster["worker"])
    with strategy.scope():
        weights = tf.Variable(tf.ones((64, 64)))
        by_worker = tf.Variable(tf.zeros((workers,), tf.int64))

    @tf.function
    def step():
        def replica():
            # Most of the step is the worker's work between reading the ps's variable and sending
            # the update, the ps waiting for it meanwhile: a fault then catches the ps waiting on
            # the worker, the failure the test is about, not by chance only.
            update = tf.while_loop(lambda i, x: i < 400, lambda i, x: (i + 1, tf.tanh(tf.matmul(x, x) * 1e-3)),
                                   (0, tf.tanh(weights)))[1]
            weights.assign_add(update * 1e-6)
            by_worker.assign_add(tf.one_hot(
                tf.distribute.coordinator.experimental_get_current_worker_index(), workers, dtype=tf.int64))
        strategy.run(replica)

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    scheduled = 0
    try:
        while not stop.is_set():
            done = by_worker.numpy().tolist()
            for _ in range(queued - (scheduled - sum(done))):
                coordinator.schedule(step)
                scheduled += 1
            print("progress " + json.dumps({"time": time.time(), "scheduled": scheduled, "by_worker": done}),
                  flush=True)
            stop.wait(0.1)
        coordinator.join()
        outcome = {"scheduled": scheduled, "by_worker": by_worker.numpy().tolist()}
    except Exception as e:  # the outcome under test, whatever its class
        outcome = {**_failure(e, "training"), "scheduled": scheduled}
    if transport == "rdma":
        import tf_rdma
        outcome["stats"] = tf_rdma.stats()
    _write(output, outcome)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
