"""`python -m tests.harness chaos`: ParameterServerStrategy training while a seeded schedule breaks
the cluster, over stock gRPC and over tf_rdma, one after the other under the same schedule.

The cluster: a coordinator (chief), 2 ps and 3 workers, each task in a network namespace of its
own (tests/harness/netns.py: veth pairs on a bridge, faults as nftables drops; needs root). The
coordinator schedules training steps (a small regression model, its variables spread over both
ps) in rounds, joins each round and reports it. The run has two phases on the same cluster:
- unfaulted, for `unfaulted_seconds`: the step rate without faults (and the warm-up after which
  the processes' resources are the baseline);
- chaos, for `--minutes`: the schedule (seeded, so gRPC and tf_rdma get the same one) kills a
  worker (SIGKILL) and starts it again on the same address, freezes a worker (SIGSTOP) for longer
  than the peer timeout, partitions a worker from a ps for less and, another time, for more than
  the peer timeout, and impairs every link for a while: 1% of the packets lost, each delayed
  20 ± 5 ms (uniform, each direction) and 1% of them duplicated (tests/harness/netns.py's lose(),
  delay() through its userspace NFQUEUE delayer, and duplicate()). Faults happen in the first three
  quarters; the last quarter is quiet, so the run ends on a cluster that recovered.

The report: steps done under chaos against the unfaulted rate, every error the coordinator saw
(TensorFlow's fault tolerance logs each worker failure it recovers from) with its class, whether
anything hung (a watchdog: the coordinator must finish a round within the longest fault plus
WATCHDOG_SLACK_S), the coordinator's and the ps' RSS, descriptors and threads from the end of the
unfaulted phase to the end of the run (flatness.judge, as the soak's), and the model's final loss against
gRPC's under the same schedule. A hang names the round and phase, the faults in flight and every
task's log (LOG_DIR/TRANSPORT/TASK.log, each line timestamped); an error the coordinator raised
before the first fault is reported as such, with none of the run's figures.
"""
import json
import logging
import os
import queue
import random
import re
import signal
import sys
import tempfile
import time

from tests.harness.flatness import SETTLE, TASK_ENVIRONMENT, Task, judge, process_sample
from tf_rdma.bench._common import coordinated_strategy, start_server

log = logging.getLogger("tf_rdma")

MODULE = "tests.harness.chaos"
PROGRESS_PREFIX = "@@round "
DONE_PREFIX = "@@done "
PORT = 2222  # every task has a namespace, hence every port, of its own
WORKERS = 3
STEPS_PER_ROUND = 30
# The "impairment" fault, on every link at once.
LOSS_PERCENT, DELAY_MS, JITTER_MS, DUPLICATE_PERCENT = 1, 20, 5, 1
IMPAIRMENT = f"{LOSS_PERCENT}% loss, {DELAY_MS} ± {JITTER_MS} ms delay, {DUPLICATE_PERCENT}% duplicated"
# From a fault's end to the coordinator's next round, at most: TCP's backed-off retransmission
# after a long partition, a restarted worker's TensorFlow start-up on a busy machine.
WATCHDOG_SLACK_S = 90.0
SAMPLE_EVERY_S = 2.0
# Flat, from the unfaulted phase's end to the run's end (each the lowest of flatness.SETTLE
# samples): RSS within the allocator's noise and the spread of what TensorFlow keeps for a cluster
# update (below; over gRPC the chief kept 23-51 MiB after one update, over tf_rdma 13-48 MiB, nine
# runs each, tf_rdma's less gRPC's in the same test -23 to +24 MiB);
# descriptors and threads back where they were. On a ps a leak of 8 KiB per step exceeds it within
# a run of --minutes 0.75 (about 4,500 steps).
GROWTH_BOUNDS = {"rss_bytes": 32 << 20, "fds": 0, "threads": 0}
# TensorFlow's coordinator recovers from a worker failure by updating the cluster
# (update_server_def), over gRPC and tf_rdma alike: the chief and every ps get a new eager client
# cache whose 4 gRPC client threads live as long as the process (gdb: GrpcEagerClientThread), the
# chief's threads at the update's start, the ps' at its end, and the chief keeps some MiB. So the
# run ends only once no update is under way and the last ended SETTLE + 1 samples ago (all the end
# samples after it), at most UPDATE_WAIT_S after the planned end; and tf_rdma's growth is judged
# against gRPC's per update (_judge_against).
CLUSTER_UPDATE_BEGINS = "Cluster now being recovered."
CLUSTER_UPDATE_ENDS = ("Cluster successfully recovered.", "Error occurred while updating server def")
UPDATE_WAIT_S = 90.0
LONG_LIVED = ("chief", "ps0", "ps1")  # never killed nor frozen by the schedule
# gRPC's event engine (TensorFlow's eager service and clients use it over tf_rdma as over gRPC) runs
# a work-stealing pool whose lifeguard starts a thread whenever all of the pool's are busy, as when a
# cluster update reconnects every task; the thread ends only once idle for 20 s (gRPC's
# kIdleThreadLimit), so under steady training it lives on. Measured (each thread's name and start
# at every sample, gdb at the end): in a run over tf_rdma ps 0 grew one as the first update began,
# there to the run's end (gdb: WorkStealingThreadPool::ThreadState::ThreadBody, named
# event_engine), +5 with the update's 4 client threads. It is the one thread beside an update's
# 4 that these runs found started, so the likely +1 of gRPC's runs' ps 0 (+5 in 2 of 9) and of
# tf_rdma's coordinator (+5 beside gRPC's +4 in 3 runs of 4 of one session, failing the judgement;
# not caught under gdb there), a thread no run keeps in step with the other transport's. So a
# process's threads are counted without the pool's, which are sampled apart ("grpc_pool_threads")
# and not judged: tf_rdma's threads take the name of the thread that starts them (python,
# tf_Compute), and none is started from the pool's, which run gRPC's own work (TensorFlow's RPC
# callbacks run on its completion-queue threads; at the runs' ends gdb found every event_engine
# thread in gRPC's frames), so a thread tf_rdma keeps is still counted.
GRPC_POOL_THREAD = "event_engine"
BEFORE_FAULTS = ("start-up", "unfaulted")  # run_transport's phases before the first fault


class ChaosError(RuntimeError):
    """The chaos run could not run (a task would not start, the network could not be made)."""


# ---- the tasks, each in its own process and namespace ----

def _model(seed=5, examples=1024, features=32, hidden=256):
    """Data and the regression to fit: y = tanh(x A) b, fixed by `seed`."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, features)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((features, 8)).astype(np.float32)) @ rng.standard_normal((8, 1)).astype(np.float32)
    first = (rng.standard_normal((features, hidden)) * 0.1).astype(np.float32)
    second = (rng.standard_normal((hidden, 1)) * 0.1).astype(np.float32)
    return x, y, first, second


class ClusterUpdates(logging.Handler):
    """The cluster updates TensorFlow's coordinator makes, from its log records: how many began,
    and whether they have settled (none under way, the last ended `quiet_s` ago or more)."""

    def __init__(self, clock=time.time):
        super().__init__()
        self.clock = clock
        self.begun = self.ended = 0
        self.last_ended_at = None

    def emit(self, record):
        message = record.getMessage()
        if message.startswith(CLUSTER_UPDATE_BEGINS):
            self.begun += 1
        elif message.startswith(CLUSTER_UPDATE_ENDS):
            self.ended += 1
            self.last_ended_at = self.clock()

    def settled(self, quiet_s):
        return self.begun == self.ended and (self.last_ended_at is None
                                             or self.clock() - self.last_ended_at >= quiet_s)


def _coordinate(spec):
    """The chief: rounds of STEPS_PER_ROUND steps, each joined and reported, until spec["seconds"]
    after its first round and, for at most UPDATE_WAIT_S more, until the cluster updates settled;
    then the final loss over all the data."""
    import numpy as np
    import tensorflow as tf
    updates = ClusterUpdates()
    tf.get_logger().addHandler(updates)
    strategy, coordinator = coordinated_strategy(spec)
    x, y, first, second = _model()
    batch = 64
    with strategy.scope():  # round robin over the ps: first and iterations on ps 0, second on ps 1
        w1 = tf.Variable(first)
        w2 = tf.Variable(second)
        iterations = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(start):
        def replica():
            inputs = tf.slice(tf.constant(x), [start, 0], [batch, x.shape[1]])
            targets = tf.slice(tf.constant(y), [start, 0], [batch, 1])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(inputs, w1)), w2) - targets))
            for variable, gradient in zip((w1, w2), tape.gradient(loss, (w1, w2))):
                variable.assign_sub(0.05 * gradient)
            iterations.assign_add(1)
            return loss
        return strategy.run(replica)

    def full_loss():
        return float(np.mean(np.square(np.tanh(x @ w1.numpy()) @ w2.numpy() - y)))

    initial_loss = full_loss()
    completed = 0
    started = None
    error = None

    def training():
        if started is None or time.time() < started + spec["seconds"]:
            return True
        return (not updates.settled((SETTLE + 1) * SAMPLE_EVERY_S)
                and time.time() < started + spec["seconds"] + UPDATE_WAIT_S)

    while training():
        try:
            for i in range(STEPS_PER_ROUND):
                start = (completed + i) * batch % (len(x) - batch + 1)
                coordinator.schedule(step, args=(tf.constant(start),))  # a tensor: one trace for all
            coordinator.join()
        except Exception as e:  # what TensorFlow raised to the user, whatever its class: reported
            error = {"class": type(e).__name__, "message": str(e)[:1000]}
            break
        completed += STEPS_PER_ROUND
        started = started or time.time()
        print(PROGRESS_PREFIX + json.dumps({"time": time.time(), "completed": completed}), flush=True)
    done = {"completed": completed, "error": error, "initial_loss": initial_loss, "cluster_updates": updates.begun}
    if error is None:
        done.update(iterations=int(iterations.numpy()), final_loss=full_loss())
    print(DONE_PREFIX + json.dumps(done), flush=True)
    os._exit(0)  # the coordinator's threads would keep polling the cluster


def task(spec):
    if spec["job"] == "chief":
        _coordinate(spec)
    start_server(spec).join()


# ---- the schedule ----

def schedule(seed, seconds, peer_timeout_s):
    """[{"at", "fault", "target", "seconds"}] in the first three quarters of `seconds`, one fault
    of each kind in a slot of its own, in an order and at times drawn from `seed`."""
    rng = random.Random(seed)
    workers = [f"worker{i}" for i in range(WORKERS)]
    faults = [("kill", rng.choice(workers), 2.0),
              ("freeze", rng.choice(workers), 2.0 * peer_timeout_s),
              ("short_partition", [rng.choice(workers), "ps0"], 0.4 * peer_timeout_s),
              ("long_partition", [rng.choice(workers), "ps1"], 2.5 * peer_timeout_s),
              ("impairment", None, 0.1 * seconds)]
    rng.shuffle(faults)
    slot = 0.75 * seconds / len(faults)
    longest = max(duration for _, _, duration in faults)
    if longest > slot:
        raise ChaosError(f"{seconds:.0f} s of faults leave {slot:.1f} s per fault, less than the longest "
                         f"({longest:.1f} s, from the peer timeout): run longer (--minutes)")
    events = []
    for i, (fault, target, duration) in enumerate(faults):
        at = i * slot + rng.uniform(0, max(0.0, slot - duration))
        events.append({"at": round(at, 2), "fault": fault, "target": target, "seconds": round(duration, 2)})
    return events


# ---- the driver ----

def _sample(pid):
    """flatness.process_sample of process `pid`, its threads without gRPC's event-engine pool's (see
    GRPC_POOL_THREAD), counted apart, both from one listing of its threads."""
    sample = process_sample(pid)
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended since the listing
            pass
    pool = names.count(GRPC_POOL_THREAD)
    return {**sample, "threads": len(names) - pool, "grpc_pool_threads": pool}


def _task(net, name, spec, log, env):
    """One task's process in its namespace, its stderr appended to the file `log` (a restarted
    worker's after its predecessor's)."""
    return Task(spec, MODULE, env, prefix=("ip", "netns", "exec", net.namespace(name)), stderr=open(log, "a"))


class _Faults:
    """Applies and lifts the schedule's faults; restarts killed workers."""

    def __init__(self, net, tasks, start):
        self.net, self.tasks, self.start = net, tasks, start

    def apply(self, event):
        fault, target = event["fault"], event["target"]
        if fault == "kill":
            self.tasks[target].stop()
        elif fault == "freeze":
            self.tasks[target].process.send_signal(signal.SIGSTOP)
        elif fault.endswith("partition"):
            self.net.partition(*target)
        elif fault == "impairment":
            self.net.lose(LOSS_PERCENT)
            self.net.delay(DELAY_MS, JITTER_MS)
            self.net.duplicate(DUPLICATE_PERCENT)

    def lift(self, event):
        fault, target = event["fault"], event["target"]
        if fault == "kill":
            self.tasks[target] = self.start(target)
        elif fault == "freeze":
            self.tasks[target].process.send_signal(signal.SIGCONT)
        elif fault.endswith("partition"):
            self.net.heal(*target)
        elif fault == "impairment":
            self.net.stop_duplicating()
            self.net.undelay()
            self.net.keep_all()


# How TensorFlow's cluster_coordinator handled a failure, from the words of its log line.
HANDLING = (("treated as a transient connectivity failure", "transient, step retried"),
            ("derived error is ignored", "ignored, step retried"),
            ("Worker ", "worker failure, steps retried once it is back"))
# A task's log: Python's lines as TASK_LOG_FORMAT writes them, C++'s (TensorFlow's and tf_rdma's)
# as absl does, "I0000 00:00:1796236505.480491  16220 file.cc:153] ..." (seconds since the epoch
# while absl's logging is not initialised, as in these tasks).
TASK_LOG_FORMAT = "%(created).6f %(levelname)s %(message)s"  # the C++ lines' clock
# The lines TensorFlow puts before a graph's error, naming no cause.
TENSORFLOW_PREAMBLE = ("Graph execution error:", "Detected at node", "<stack traces unavailable>")
LOG_LINE = re.compile(r"\n(?:\d+\.\d+ (?:CRITICAL|ERROR|WARNING|INFO|DEBUG) |[IWEF]\d{4} \d\d:\d\d:)")


def _errors_seen(chief_log):
    """{"CLASS (handling)": {"count", "example"}}: the failures the coordinator logged and
    recovered from ("Worker ... failed with UnavailableError():...", "Remote function on worker
    ... failed with ..."). The example is the message's line naming the cause (tf_rdma's, if any)."""
    seen = {}
    for match in re.finditer(r"(?:^|\n)\d+\.\d+ ERROR (.*?)failed with (\w+)\(\)?:?", chief_log):
        rest = chief_log[match.end():match.end() + 4000]
        end = LOG_LINE.search(rest)
        message = rest[:end.start() if end else len(rest)]
        handling = next((h for words, h in HANDLING if words in match.group(1) + message), "handling not known")
        lines = [line.strip() for line in message.splitlines()
                 if line.strip() and not line.strip().startswith(TENSORFLOW_PREAMBLE)]
        # tf_rdma's words may come quoted inside gRPC's (a ps's failure relayed by the worker).
        cause = next((line[line.index("tf_rdma:"):] for line in lines if "tf_rdma:" in line), " ".join(lines[:3]))
        entry = seen.setdefault(f"{match.group(2)} ({handling})", {"count": 0, "example": cause[:400]})
        if "tf_rdma:" in cause and "tf_rdma:" not in entry["example"]:
            entry["example"] = cause[:400]  # tf_rdma's own words, where any occurrence has them
        entry["count"] += 1
    return seen


def run_transport(transport, seconds, unfaulted_seconds, events, peer_timeout_s, log_dir, progress=None):
    """One run over `transport` ("grpc" or a tf_rdma backend): its rates, errors, hang, flatness.
    Every task it started is stopped and its network deleted however it ends (an error while
    starting, the watchdog, ^C): a task left running would outlive its namespace, which
    `ip netns del` only unlinks."""
    from tests.harness import netns
    # TF_CPP_MIN_LOG_LEVEL=0: TensorFlow's C++ INFO lines and tf_rdma's (which logs through it:
    # connections made, refused and lost, with the peer), each stamped with the time, so a hang's
    # log says what each task saw last.
    env = {**TASK_ENVIRONMENT, "TF_RDMA_PEER_TIMEOUT_MS": str(int(peer_timeout_s * 1000)),
           "TF_CPP_MIN_LOG_LEVEL": "0"}
    names = ["chief", "ps0", "ps1"] + [f"worker{i}" for i in range(WORKERS)]
    logs = {name: f"{log_dir}/{name}.log" for name in names}
    tasks = {}
    pending = sorted(events, key=lambda e: e["at"])
    applied, active = [], []  # applied: events with their wall-clock "applied_at"; active: (lift time, event)
    rounds, samples, done, hang = [], [], None, None
    chaos_start = last_lift = None

    def phase():
        """Where the run is, for a hang or an error: "start-up" (no round yet), "unfaulted" (no
        fault yet), "faults" (one in flight or more to come) or "quiet" (all lifted)."""
        if not rounds:
            return "start-up"
        if not applied:
            return "unfaulted"
        return "faults" if active or pending else "quiet"

    with netns.Network() as net:
        try:
            for name in names:
                net.add_host(name)
            cluster = {"chief": [f"{net.address('chief')}:{PORT}"],
                       "ps": [f"{net.address(f'ps{i}')}:{PORT}" for i in range(2)],
                       "worker": [f"{net.address(f'worker{i}')}:{PORT}" for i in range(WORKERS)]}

            def start(name):
                job, index = name.rstrip("0123456789"), int(name[-1]) if name != "chief" else 0
                return _task(net, name, {"cluster": cluster, "job": job, "index": index, "transport": transport,
                                         "seconds": unfaulted_seconds + seconds}, logs[name], env)

            for name in names[1:] + names[:1]:  # the chief last: it connects to the others
                tasks[name] = start(name)
            faults = _Faults(net, tasks, start)
            longest = max([e["seconds"] for e in events], default=0.0)
            last_round = time.monotonic()
            next_sample = 0.0
            while done is None:
                now = time.monotonic()
                if chaos_start is not None:
                    while pending and now >= chaos_start + pending[0]["at"]:
                        event = {**pending.pop(0), "applied_at": round(time.time(), 3)}
                        faults.apply(event)
                        applied.append(event)
                        active.append((now + event["seconds"], event))
                        if progress:
                            progress(f"chaos over {transport}: {event['fault']} {_target(event)} "
                                     f"for {event['seconds']} s")
                    for lift_at, event in [a for a in active if now >= a[0]]:
                        faults.lift(event)
                        active.remove((lift_at, event))
                        last_lift = now
                # The chief's end is read from its stdout (its last line, then EOF), not polled: it
                # exits once done, maybe before that line is read.
                if rounds and now >= next_sample and tasks["chief"].process.poll() is None:
                    for name in ("ps0", "ps1"):
                        if tasks[name].process.poll() is not None:
                            raise ChaosError(f"chaos over {transport}: {name} exited "
                                             f"({tasks[name].process.returncode}) in the {phase()} phase; "
                                             f"see {logs[name]}")
                    samples.append({"seconds": now - rounds[0]["monotonic"],
                                    **{name: _sample(tasks[name].process.pid) for name in LONG_LIVED}})
                    next_sample = now + SAMPLE_EVERY_S
                # Before the first round TensorFlow starts up on every task: not a hang.
                limit = (longest + WATCHDOG_SLACK_S) if rounds else WATCHDOG_SLACK_S * 3
                if now - last_round > limit:
                    hang = {"round": len(rounds) + 1, "phase": phase(), "waited_s": round(now - last_round, 1),
                            "at": round(time.time(), 3),
                            "last_round_at": rounds[-1]["time"] if rounds else None,
                            "active_faults": [e for _, e in active], "last_fault": applied[-1] if applied else None,
                            "logs": logs}
                    break
                try:
                    line = tasks["chief"].lines.get(timeout=0.1)
                except queue.Empty:
                    continue
                if line is None:
                    raise ChaosError(f"chaos over {transport}: the coordinator exited "
                                     f"({tasks['chief'].process.wait()}) in the {phase()} phase; "
                                     f"see {logs['chief']}")
                if line.startswith(PROGRESS_PREFIX):
                    report = json.loads(line[len(PROGRESS_PREFIX):])
                    report["monotonic"] = last_round = time.monotonic()
                    rounds.append(report)
                    if chaos_start is None and last_round - rounds[0]["monotonic"] >= unfaulted_seconds:
                        chaos_start = last_round
                        warmup_samples = len(samples)
                        if progress:
                            progress(f"chaos over {transport}: unfaulted phase done, "
                                     f"{report['completed']} steps; faults start")
                elif line.startswith(DONE_PREFIX):
                    done = json.loads(line[len(DONE_PREFIX):])
                    if done["error"]:
                        done["error"]["phase"] = phase()
        finally:
            # Faults need no lifting: the network goes, and stop() resumes a frozen task to kill it.
            for t in tasks.values():
                t.stop()
    with open(logs["chief"]) as f:
        errors = _errors_seen(f.read())
    result = {"transport": transport, "hang": hang, "errors": errors, "rounds": rounds, "samples": samples}
    if hang:
        return result
    result.update(done)
    if done["error"] and done["error"]["phase"] in BEFORE_FAULTS:
        return result  # the cluster failed before any fault: no figure of this run is a fault's outcome
    at_chaos = next(r for r in rounds if r["monotonic"] >= chaos_start)
    unfaulted_rate = ((at_chaos["completed"] - rounds[0]["completed"]) / (at_chaos["time"] - rounds[0]["time"])
                      if at_chaos is not rounds[0] else None)
    chaos_steps = rounds[-1]["completed"] - at_chaos["completed"]
    chaos_rate = chaos_steps / (rounds[-1]["time"] - at_chaos["time"]) if rounds[-1] is not at_chaos else None
    result.update(unfaulted_steps_per_second=unfaulted_rate, chaos_steps=chaos_steps,
                  chaos_steps_per_second=chaos_rate,
                  # The cluster recovered from every fault: steps done once all were lifted.
                  steps_after_last_fault=rounds[-1]["completed"] - max(
                      [r["completed"] for r in rounds if last_lift is not None and r["monotonic"] <= last_lift],
                      default=rounds[-1]["completed"]),
                  steps_vs_unfaulted=chaos_rate / unfaulted_rate if unfaulted_rate and chaos_rate is not None
                  else None,
                  lost_steps=max(0, done["completed"] - done.get("iterations", done["completed"])),
                  # TensorFlow runs a step again when its worker failed before reporting it.
                  steps_run_twice=max(0, done.get("iterations", done["completed"]) - done["completed"]))
    if done["error"]:
        return result  # no growth to judge on a cluster that did not recover
    # The baseline: the unfaulted phase's last samples.
    verdict = judge(samples, max(0, warmup_samples - SETTLE), GROWTH_BOUNDS, processes=LONG_LIVED)
    result.update(flatness=verdict, flat=all(q["flat"] for p in verdict.values() for q in p.values()))
    # For the record, not judged (GRPC_POOL_THREAD): how gRPC's pool grew, over the same samples.
    pool = judge(samples, max(0, warmup_samples - SETTLE), {"grpc_pool_threads": 0}, processes=LONG_LIVED)
    result["grpc_pool_growth"] = {p: pool[p]["grpc_pool_threads"]["growth"] for p in LONG_LIVED}
    return result


def run(backend="tcp", minutes=3.0, seed=1, peer_timeout_ms=2000, unfaulted_seconds=None, log_dir=None,
        progress=None):
    """{"schedule": [...], "runs": [gRPC's, tf_rdma's], ...} under the same seeded schedule."""
    from tests.harness import netns
    reason = netns.unavailable_reason("each task of the chaos run gets a network namespace of its own")
    if reason:
        raise ChaosError(reason)
    netns.check_tools(purpose="the chaos run")
    seconds = minutes * 60
    unfaulted_seconds = unfaulted_seconds or max(15.0, seconds / 4)
    peer_timeout_s = peer_timeout_ms / 1000
    events = schedule(seed, seconds, peer_timeout_s)
    log_dir = log_dir or tempfile.mkdtemp(prefix="tf_rdma_chaos_")
    report = {"backend": backend, "seed": seed, "minutes": minutes, "unfaulted_seconds": unfaulted_seconds,
              "peer_timeout_ms": peer_timeout_ms, "schedule": events, "log_dir": log_dir, "runs": []}
    for transport in ("grpc", backend):
        directory = f"{log_dir}/{transport}"
        os.makedirs(directory, exist_ok=True)
        if progress:
            progress(f"chaos over {transport}: {unfaulted_seconds:.0f} s unfaulted, then {seconds:.0f} s "
                     f"of faults (logs in {directory})")
        report["runs"].append(run_transport(transport, seconds, unfaulted_seconds, events, peer_timeout_s,
                                            directory, progress))
    grpc, ours = report["runs"]
    if "flatness" in grpc and "flatness" in ours:
        _judge_against(ours, grpc)
    report["final_loss_vs_grpc"] = (ours["final_loss"] / grpc["final_loss"]
                                    if "final_loss" in ours and grpc.get("final_loss") else None)
    report["ok"] = all(not r["hang"] and r.get("error") is None and r.get("flat") and r.get("lost_steps") == 0
                       and r.get("steps_after_last_fault", 0) > 0 for r in report["runs"][1:])
    return report


def _target(event):
    target = event["target"]
    return " <-> ".join(target) if isinstance(target, list) else (target or "every link")


def _fault(event):
    return f"{event['fault']} {_target(event)} for {event['seconds']} s from {event['applied_at']:.3f}"


# Every cluster update gives the coordinator and each ps an eager client cache of the same size, so
# each of them measures TensorFlow's threads per update; the most any grew over gRPC takes in a
# client thread of an earlier cache that TensorFlow ends about an update (the coordinator's -1: a
# completion-queue thread of an earlier cache, gdb's cq_next, ended as an update ended, in 2 runs of
# 3 over tf_rdma; over gRPC the coordinator +3 in one of nine, over tf_rdma in two). gRPC's event-engine
# pool's threads are not counted (GRPC_POOL_THREAD).
ALIKE_IN_EVERY_PROCESS = ("threads",)


def _judge_against(ours, grpc):
    """tf_rdma's growth may exceed the bound by what TensorFlow itself kept over gRPC under the same
    schedule, per cluster update (see CLUSTER_UPDATE_BEGINS): gRPC's growth, when positive, divided
    by gRPC's updates and times tf_rdma's (all of it if gRPC's run made none); for a quantity in
    ALIKE_IN_EVERY_PROCESS, gRPC's largest growth of any long-lived process."""
    for process, quantities in ours["flatness"].items():
        for quantity, q in quantities.items():
            q["grpc_growth"] = grpc["flatness"][process][quantity]["growth"]
            measured = (max(grpc["flatness"][p][quantity]["growth"] for p in grpc["flatness"])
                        if quantity in ALIKE_IN_EVERY_PROCESS else q["grpc_growth"])
            q["grpc_allowance"] = tensorflow_allowance(measured, grpc["cluster_updates"], ours["cluster_updates"])
            q["flat"] = q["growth"] <= q["bound"] + q["grpc_allowance"]
    ours["flat"] = all(q["flat"] for p in ours["flatness"].values() for q in p.values())


def tensorflow_allowance(grpc_growth, grpc_updates, our_updates):
    """What TensorFlow keeps, measured over gRPC, for tf_rdma's run's cluster updates."""
    grown = max(0, grpc_growth)
    return grown if grpc_updates == 0 else grown * our_updates / grpc_updates


def render(report):
    name = {"grpc": "gRPC", report["backend"]: f"tf_rdma {report['backend']}"}
    lines = [f"chaos run, seed {report['seed']}: {report['unfaulted_seconds']:.0f} s unfaulted, then "
             f"{report['minutes'] * 60:.0f} s of faults; TF_RDMA_PEER_TIMEOUT_MS={report['peer_timeout_ms']}; "
             f"1 coordinator, 2 ps, {WORKERS} workers, each in a network namespace",
             "schedule (seconds into the faulted phase):"]
    for e in report["schedule"]:
        lines.append(f"  {e['at']:6.1f}  {e['fault']:<15} {_target(e):<18} {e['seconds']:.1f} s"
                     + (f" ({IMPAIRMENT})" if e["fault"] == "impairment" else ""))

    def row(label, value):
        lines.append(f"  {label:<34}" + "".join(f" {value(r):>22}" for r in report["runs"]))

    lines.append(f"  {'':<34}" + "".join(f" {name[r['transport']]:>22}" for r in report["runs"]))

    def figure(key, fmt):
        return lambda r: "-" if r.get(key) is None else format(r[key], fmt)
    row("hang (watchdog)", lambda r: "HANG" if r["hang"] else "no")
    row("steps/s unfaulted", figure("unfaulted_steps_per_second", ".1f"))
    row("steps/s under faults", figure("chaos_steps_per_second", ".1f"))
    row("steps under faults vs unfaulted", figure("steps_vs_unfaulted", ".2f"))
    row("steps after the last fault", figure("steps_after_last_fault", "d"))
    row("steps lost (completed - ran)", figure("lost_steps", "d"))
    row("steps run again (retried)", figure("steps_run_twice", "d"))
    row("error raised to the coordinator", lambda r: "none" if not r.get("error") else r["error"]["class"] + (
        " (before faults)" if r["error"]["phase"] in BEFORE_FAULTS else ""))
    row("final loss (initial)", lambda r: (f"{r['final_loss']:.4f} ({r['initial_loss']:.3f})"
                                           if "final_loss" in r else "-"))
    row("cluster updates (recoveries)", figure("cluster_updates", "d"))
    for process in LONG_LIVED:
        row(f"{process} growth: RSS, fds, threads", lambda r: "-" if "flatness" not in r else ", ".join(
            [f"{r['flatness'][process]['rss_bytes']['growth'] / (1 << 20):+.1f} MiB"]
            + [f"{r['flatness'][process][q]['growth']:+d}" for q in ("fds", "threads")]))
    row("event_engine threads chief/ps0/ps1", lambda r: "-" if "grpc_pool_growth" not in r else " / ".join(
        f"{r['grpc_pool_growth'][p]:+d}" for p in LONG_LIVED))
    row("flat (*)", lambda r: "-" if r["transport"] == "grpc" or "flat" not in r else
        ("yes" if r["flat"] else "GREW"))
    lines.append(f"  (*) chief and ps: growth, the lowest of the run's last {SETTLE} samples less the lowest of "
                 f"the {SETTLE} before the faults, at most {GROWTH_BOUNDS['rss_bytes'] >> 20} MiB of RSS and 0 "
                 "descriptors and threads (not counting gRPC's event-engine pool's, its growth shown apart), "
                 "each plus what gRPC's run grew (if it grew) under the same schedule, per cluster update, "
                 "times tf_rdma's run's updates")
    for r in report["runs"]:
        if r["hang"]:
            h = r["hang"]
            lines.append(f"  {name[r['transport']]} hung in round {h['round']} ({h['phase']} phase), no round for "
                         f"{h['waited_s']:.0f} s until {h['at']:.3f} (the logs' clock); in flight: "
                         f"{', '.join(_fault(e) for e in h['active_faults']) or 'no fault'}"
                         + (f"; last fault: {_fault(h['last_fault'])}"
                            if h["last_fault"] and h["last_fault"] not in h["active_faults"] else "")
                         + f"; logs: {', '.join(h['logs'].values())}")
        elif r.get("error"):
            e = r["error"]
            lines.append(f"  {name[r['transport']]}: the coordinator raised {e['class']} in the {e['phase']} phase"
                         + (" (before any fault: the cluster could not train, not a fault's outcome)"
                            if e["phase"] in BEFORE_FAULTS else "") + f": {e['message'][:400]}")
    if report["final_loss_vs_grpc"] is not None:
        lines.append(f"  final loss, tf_rdma / gRPC: {report['final_loss_vs_grpc']:.2f}")
    lines.append("failures TensorFlow's coordinator logged and recovered from:")
    for error in sorted({c for r in report["runs"] for c in r["errors"]}):
        lines.append(f"  {error}: " + ", ".join(f"{name[r['transport']]} {r['errors'].get(error, {}).get('count', 0)}"
                                                for r in report["runs"]))
        for r in report["runs"]:
            if error in r["errors"]:
                lines.append(f"    {name[r['transport']]}, e.g.: {r['errors'][error]['example'][:240]}")
    lines.append("ok" if report["ok"] else "NOT OK (tf_rdma): a hang, an error, a lost step, no step after the "
                 "last fault, or growth (see above)")
    return "\n".join(lines)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=TASK_LOG_FORMAT)
    task(json.loads(sys.argv[1]))
