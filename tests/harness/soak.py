"""`python -m tests.harness soak`: a TF1 training loop run for minutes over one tf_rdma backend,
watching whether the processes that stay up keep what they should give back.

The cluster is three processes on this host: ps 0 (long-lived), ps 1 (the peer restarted mid-run)
and worker 0 (the session's client and master; long-lived). Every training step moves tensors both
ways: eight small variables (1 KiB each, inline messages) and a large one (1 MiB, receive pools)
from ps 0, a small and a medium one from ps 1, read onto the worker and updated there by gradients
sent back, and one ps 0 -> ps 1 tensor. After each round of steps (about a second) one step is
cancelled mid-transfer: the worker sends ps 0 a fresh 1 MiB tensor while ps 0 blocks on a queue
nobody feeds and the worker waits for its answer, until the step's RunOptions deadline aborts it.
Every `restart_seconds` the driver kills ps 1 (SIGKILL) while steps run and starts it again; the
worker's loop reopens its session, initializes ps 1's variables again and carries on.

After each round the driver samples ps 0 and the worker: RSS, open descriptors, threads, the
tf_rdma receive pools' region bytes (tf_rdma.stats()) and the bytes of shared memory (memfd)
mapped. After the warm-up (at least the first third of the run, and until the worker recovered
from the first restart, so that everything created lazily for steps, cancellations and new
sessions exists), each quantity must stay flat: its end value may exceed its value when warm-up
ended by at most GROWTH_BOUNDS, each value the lowest of SETTLE samples in a row. A leak raises
that floor; a transient (a thread or a descriptor alive for a moment, a step's tensors) does not.
The run lasts its time, or longer where restarts took so much of it that fewer than 2 * SETTLE
samples came after warm-up (a slow or loaded host), up to MOST_SECONDS_FACTOR times its time.
"""
import json
import logging
import queue
import signal
import threading
import time

from tests.harness.flatness import SETTLE, Task, judge, process_sample
from tf_rdma.bench._common import local_cluster, open_session, start_server
from tf_rdma.transport import available_backends

log = logging.getLogger("tf_rdma")

ROUND_PREFIX = "@@round "
STATS_PREFIX = "@@stats "
DONE_PREFIX = "@@done "
MODULE = "tests.harness.soak"

SMALL_FLOATS = 256          # 1 KiB: travels inline with its header
SMALL_COUNT = 8
LARGE_FLOATS = 256 << 10    # 1 MiB: travels through a receive pool
MEDIUM_FLOATS = 16 << 10    # 64 KiB
CANCELLED_FLOATS = 256 << 10
RUN_AHEAD_ITERATIONS = 4

# What "flat" allows once warm-up is over. RSS: the allocator's own noise (arenas, fragmentation)
# over a run, far below what holding one cancelled step's 1 MiB tensor per round would add.
# Counts of descriptors and threads must come back to what they were; pools must not grow.
# Live steps (step rendezvous alive): the ones running and ended ones still held for a moment
# (cc/tf/rendezvous); a leak adds steps every second.
GROWTH_BOUNDS = {"rss_bytes": 8 << 20, "fds": 0, "threads": 0, "region_bytes": 0, "mapped_shm_bytes": 0,
                 "live_steps": 20}
WARMUP_FRACTION = 1 / 3
PROCESSES = ("worker", "ps")  # the long-lived processes, judged; ps 1 restarts so has no trend


class SoakError(RuntimeError):
    """The soak's cluster failed (a task died, or the worker stopped reporting)."""


# ---- the tasks, each in its own process ----

def _stats_sample(stats):
    """The receive pools' region bytes and the live steps, from a task's tf_rdma.stats()."""
    return {"region_bytes": sum(pool["region_bytes"] for pool in stats.get("receive_pools", {}).values()),
            "live_steps": stats.get("live_steps", 0)}


def _serve(spec):
    """A ps: serves, and prints its tf_rdma stats every half second for the driver to sample."""
    import tf_rdma
    server = start_server(spec)  # noqa: F841 (held: the server stops when collected)
    while True:  # until the driver kills the task
        print(STATS_PREFIX + json.dumps(tf_rdma.stats()), flush=True)
        time.sleep(0.5)


class _Model:
    """The worker's graph: the training step and the step that is cancelled mid-transfer."""

    def __init__(self, tf):
        ps0, ps1, worker = "/job:ps/task:0", "/job:ps/task:1", "/job:worker/task:0"

        def variable(device, floats, name):
            with tf.device(device):
                return tf.compat.v1.Variable(tf.zeros([floats]), name=name, use_resource=True)
        on_ps0 = [variable(ps0, SMALL_FLOATS, f"small{i}") for i in range(SMALL_COUNT)]
        on_ps0.append(variable(ps0, LARGE_FLOATS, "large"))
        on_ps1 = [variable(ps1, SMALL_FLOATS, "peer_small"), variable(ps1, MEDIUM_FLOATS, "peer_medium")]
        updates = []
        for v in on_ps0 + on_ps1:
            with tf.device(worker):
                gradient = tf.tanh(v.read_value() + 1.0) * 1e-3
            with tf.device(v.device):
                updates.append(v.assign_sub(gradient).op)
        with tf.device(ps1):
            updates.append(on_ps1[0].assign_add(on_ps0[0].read_value() * 1e-3).op)
        self.train = tf.group(*updates)
        self.initialize = tf.compat.v1.variables_initializer(on_ps0 + on_ps1)
        self.initialize_peer = tf.compat.v1.variables_initializer(on_ps1)

        with tf.device(ps0):
            never_fed = tf.queue.FIFOQueue(1, tf.float32, shapes=[[]], shared_name="tf_rdma_soak_never_fed")
            total = tf.zeros([])
        with tf.device(worker):
            payload = tf.random.uniform([CANCELLED_FLOATS])  # a fresh tensor each step
        with tf.device(ps0):
            stalled = tf.reduce_sum(payload) + never_fed.dequeue()
        with tf.device(worker):
            self.cancelled = [stalled * 2.0, run_ahead_loop(tf, ps0, worker, never_fed, total)]


def run_ahead_loop(tf, ps, worker, never_fed, total):
    """Sends whose receives are never issued (needs TF1 control flow): a loop whose counter runs on
    the worker and whose sum runs on the ps, one iteration at a time. The worker runs all
    RUN_AHEAD_ITERATIONS at once, sending the ps a fresh 1 MiB tensor in each; the ps blocks on
    `never_fed` in its first, so it never issues the receives of the others before the step ends."""
    def body(i, running_total):
        with tf.device(worker):
            part = tf.random.uniform([CANCELLED_FLOATS]) + tf.cast(i, tf.float32)
        with tf.device(ps):
            running_total = running_total + tf.reduce_sum(part) + never_fed.dequeue()
        with tf.device(worker):
            return i + 1, running_total
    with tf.device(worker):
        _, summed = tf.while_loop(lambda i, _: i < RUN_AHEAD_ITERATIONS, body,
                                  [tf.constant(0), total], parallel_iterations=1)
    # The loop's own ops for the sum (Enter, Merge, Switch, ...) are placed with it on the ps, or
    # the worker's iterations would wait for the ps's.
    for op in _loop_ops_of(summed):
        op._set_device(ps)  # noqa: SLF001 (graph mode has no public way to place them apart)
    return summed


def _loop_ops_of(exit_tensor):
    """The control-flow ops that carry one loop variable of a TF1 while loop, from its Exit back:
    its Switch, Merge, Enter, NextIteration and the body's Identity."""
    switch = exit_tensor.op.inputs[0].op
    merge = switch.inputs[0].op
    enter, next_iteration = (t.op for t in merge.inputs)
    identity = next(c for c in switch.outputs[1].consumers() if c.type == "Identity")
    return [exit_tensor.op, switch, merge, enter, next_iteration, identity]


def _train(spec):
    """The worker: rounds of training steps, each followed by a step cancelled at its deadline,
    until the driver sends SIGUSR1; reopens its session whenever a step fails (ps 1 was restarted)."""
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    import tensorflow as tf
    import tf_rdma
    # TF1 control flow: its while loop is partitioned per device, so each task runs its iterations
    # on its own (v2's While is one op on one device).
    tf.compat.v1.disable_control_flow_v2()
    server = start_server(spec)
    model = _Model(tf)
    session = open_session(server)
    session.run(model.initialize)
    params = spec["params"]
    step_deadline = tf.compat.v1.RunOptions(timeout_in_ms=params["step_timeout_ms"])
    cancel_deadline = tf.compat.v1.RunOptions(timeout_in_ms=params["cancel_after_ms"])
    counts = {"steps": 0, "cancelled_steps": 0, "failed_steps": 0, "sessions": 1}
    while not stop.is_set():
        round_end = time.monotonic() + params["round_seconds"]
        try:
            while time.monotonic() < round_end:
                session.run(model.train, options=step_deadline)
                counts["steps"] += 1
            try:
                session.run(model.cancelled, options=cancel_deadline)
                raise SoakError("the step meant to be cancelled finished: its queue was fed")
            except tf.errors.DeadlineExceededError:
                counts["cancelled_steps"] += 1
        except tf.errors.OpError as e:
            # A restarted ps lost its variables and the session's graphs: a new session and
            # initialized variables, as a TF1 training script would recover.
            counts["failed_steps"] += 1
            log.info("soak: step failed (%s: %s); reopening the session", type(e).__name__,
                     str(e).splitlines()[0][:200])
            session.close()
            session = open_session(server)
            session.run(model.initialize_peer)
            counts["sessions"] += 1
            continue
        print(ROUND_PREFIX + json.dumps({**counts, "stats": tf_rdma.stats()}), flush=True)
    print(DONE_PREFIX + json.dumps(counts), flush=True)
    while True:  # alive until the driver kills it, so the last round's sample sees this process
        time.sleep(60)


def task(spec):
    """One task of the soak's cluster, in its own process."""
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    if spec["job"] == "ps":
        _serve(spec)
    else:
        _train(spec)


# ---- sampling ----

def transfers(worker_stats, ps_stats):
    """(tensors, bytes) moved: every transfer the worker sent or received, and ps 0's with ps 1;
    each has an end in a long-lived process, so each is counted once and none is lost to a restart."""
    tensors = nbytes = 0
    peers = list(worker_stats.get("peers", {}).values())
    peers += [p for name, p in ps_stats.get("peers", {}).items() if name != worker_stats.get("task")]
    for peer in peers:
        tensors += peer["tensors_sent"] + peer["tensors_received"]
        nbytes += peer["bytes_sent"] + peer["bytes_received"]
    return tensors, nbytes


# ---- the driver ----

PARAMS = {"round_seconds": 1.0, "cancel_after_ms": 300, "step_timeout_ms": 60_000}
# A slow or loaded host spends more of the run restarting ps 1 and reopening sessions: the run
# goes on past its time until flatness has the samples it needs, up to this many times its time.
MOST_SECONDS_FACTOR = 3


def warmup_end(samples, seconds):
    """The index of the first sample after warm-up (len(samples) while it lasts)."""
    return next((i for i, s in enumerate(samples)
                 if s["seconds"] >= seconds * WARMUP_FRACTION and s["sessions"] > 1), len(samples))


def run_is_over(samples, seconds):
    """Whether a run of `seconds` has its samples: the time is up and flatness can be judged, or
    MOST_SECONDS_FACTOR times the time is up (judge then says to run longer)."""
    elapsed = samples[-1]["seconds"]
    enough = len(samples) - warmup_end(samples, seconds) >= 2 * SETTLE
    return elapsed >= seconds * (1 if enough else MOST_SECONDS_FACTOR)


def run_backend(backend, seconds, restart_seconds, progress=None):
    """One soak over `backend`: its samples, counts, transfers and flatness verdict."""
    cluster = local_cluster({"ps": 2, "worker": 1})

    def spec(job, index):
        return {"cluster": cluster, "job": job, "index": index, "transport": backend, "params": PARAMS}
    ps, peer = Task(spec("ps", 0), MODULE), Task(spec("ps", 1), MODULE)
    worker = Task(spec("worker", 0), MODULE)
    tasks = {"ps": ps, "peer": peer, "worker": worker}
    samples, restarts, ps_stats, done = [], 0, None, None
    started = last_restart = None  # the worker's first round: its session is up
    try:
        while done is None:
            try:
                line = worker.lines.get(timeout=PARAMS["step_timeout_ms"] / 1000 + 120)
            except queue.Empty:
                raise SoakError(f"soak over {backend}: the worker reported nothing for two minutes:\n"
                                f"{worker.error_tail()}") from None
            if line is None:
                raise SoakError(f"soak over {backend}: the worker exited ({worker.process.wait()}):\n"
                                f"{worker.error_tail()}")
            if line.startswith(DONE_PREFIX):
                done = json.loads(line[len(DONE_PREFIX):])
                continue
            if not line.startswith(ROUND_PREFIX):
                continue
            round_report = json.loads(line[len(ROUND_PREFIX):])
            now = time.monotonic()
            if started is None:
                started = last_restart = now
            if ps.process.poll() is not None:
                raise SoakError(f"soak over {backend}: ps 0 exited:\n{ps.error_tail()}")
            ps_stats = ps.latest(STATS_PREFIX) or ps_stats or {}
            worker_stats = round_report.pop("stats")
            tensors, nbytes = transfers(worker_stats, ps_stats)
            sample = {"seconds": now - started, **round_report, "restarts": restarts,
                      "tensors": tensors, "bytes": nbytes,
                      "worker": {**process_sample(worker.process.pid), **_stats_sample(worker_stats)},
                      "ps": {**process_sample(ps.process.pid), **_stats_sample(ps_stats)}}
            samples.append(sample)
            if progress and len(samples) % 5 == 0:
                progress(f"soak over {backend}: {sample['seconds']:.0f} s, {sample['steps']} steps, "
                         f"{sample['cancelled_steps']} cancelled, {restarts} restarts, {tensors} tensors; "
                         f"RSS worker {sample['worker']['rss_bytes'] >> 20} MiB, "
                         f"ps {sample['ps']['rss_bytes'] >> 20} MiB")
            if run_is_over(samples, seconds):
                worker.process.send_signal(signal.SIGUSR1)  # ends after its round, with @@done
            # None in the last quarter: the run ends on samples of a cluster that recovered.
            elif now - last_restart >= restart_seconds and now - started < seconds * 3 / 4:
                peer.process.send_signal(signal.SIGKILL)
                peer.stop()
                peer = tasks["peer"] = Task(spec("ps", 1), MODULE)
                restarts += 1
                last_restart = now
    finally:
        for t in tasks.values():
            t.stop()
    warmup_samples = warmup_end(samples, seconds)
    verdict = judge(samples, warmup_samples, GROWTH_BOUNDS, PROCESSES)
    last = samples[-1]
    return {"backend": backend, "seconds": seconds, "restart_seconds": restart_seconds, **done,
            "restarts": restarts, "tensors": last["tensors"], "bytes": last["bytes"],
            "tensors_after_warmup": last["tensors"] - samples[warmup_samples]["tensors"],
            "warmup_samples": warmup_samples, "samples": samples, "flatness": verdict,
            "flat": all(q["flat"] for process in verdict.values() for q in process.values())}


def run(backends, minutes, restart_seconds=None, progress=None):
    """{"backends": [...], "unavailable": {backend: reason}, "runs": [one soak per backend], "flat"}"""
    seconds = minutes * 60
    # Restarts in warm-up and after it (at least two per run), at most one every 20 s.
    restart_seconds = restart_seconds or min(20.0, seconds / 4)
    usable = available_backends()
    carried = [b for b in backends if usable.get(b) is None]
    report = {"backends": carried, "minutes": minutes,
              "unavailable": {b: usable.get(b, "unknown backend") for b in backends if b not in carried},
              "runs": []}
    for backend in carried:
        if progress:
            progress(f"soak over {backend} for {seconds:.0f} s")
        report["runs"].append(run_backend(backend, seconds, restart_seconds, progress))
    report["flat"] = all(r["flat"] for r in report["runs"])
    return report


def _mib(value):
    return f"{value / (1 << 20):.1f} MiB"


def render(report):
    lines = [f"{backend}: unavailable: {reason}" for backend, reason in report["unavailable"].items()]
    for run_report in report["runs"]:
        lines.append(f"soak over {run_report['backend']}: {run_report['seconds']:.0f} s, "
                     f"{run_report['steps']} steps, {run_report['cancelled_steps']} cancelled mid-transfer, "
                     f"{run_report['restarts']} peer restarts ({run_report['failed_steps']} steps failed "
                     f"with them), {run_report['tensors']} tensors / {_mib(run_report['bytes'])} moved, "
                     f"{run_report['tensors_after_warmup']} tensors after warm-up")
        lines.append(f"  {'s':>5} {'steps':>7} {'tensors':>9}"
                     + "".join(f" | {p + ' RSS':>12} {'fds':>4} {'thr':>4} {'pools':>10} {'shm':>10} {'live':>4}"
                               for p in PROCESSES))
        for i, s in enumerate(run_report["samples"]):
            mark = "*" if i == run_report["warmup_samples"] else " "
            line = f"{mark} {s['seconds']:5.0f} {s['steps']:7d} {s['tensors']:9d}"
            for p in PROCESSES:
                q = s[p]
                line += (f" | {_mib(q['rss_bytes']):>12} {q['fds']:4d} {q['threads']:4d}"
                         f" {_mib(q['region_bytes']):>10} {_mib(q['mapped_shm_bytes']):>10} {q['live_steps']:4d}")
            lines.append(line)
        lines.append("  (* warm-up ends; flat: end - baseline <= bound, each the lowest of "
                     f"{SETTLE} samples in a row)")
        for process, quantities in run_report["flatness"].items():
            for quantity, q in quantities.items():
                unit = _mib if quantity.endswith("bytes") else str
                lines.append(f"  {process:>6} {quantity:<17} {unit(q['baseline']):>12} -> {unit(q['end']):>12}"
                             f"  growth {unit(q['growth']):>10} (bound {unit(q['bound'])}): "
                             f"{'flat' if q['flat'] else 'GREW'}")
    lines.append("flat" if report["flat"] else "NOT FLAT: something grew after warm-up")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    task(json.loads(sys.argv[1]))
