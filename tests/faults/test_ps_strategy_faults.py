"""ParameterServerStrategy through a worker partitioned from the coordinator and the ps, and a
worker frozen (SIGSTOP), each for FAULT_S, longer than TF_RDMA_PEER_TIMEOUT_MS, then healed or
resumed: a coordinator, a ps and two workers, each in a network namespace of its own
(tests/harness/netns.py). One cluster per run plays both faults on worker 0, one after the other; worker
1 stays healthy. The coordinator never joins while it trains (a join waits for the faulted worker's
step): it keeps steps queued and prints what each worker has done
(tests/tf/programs/fault.py through_worker_faults). Three runs, the same faults:

- "grpc": stock gRPC with TensorFlow's settings. The comparison's finding: nothing fails. TensorFlow
  sets no keepalive on its channels, so the faulted worker's step in flight waits for TCP to
  deliver again after the heal (TCP's backed-off retransmission: up to ~2 s after a 5 s partition)
  or the thaw, and the coordinator, which never sees an error, uses the worker again then. (How
  long gRPC would hold the step of a worker that never comes back, this test does not wait for.)
- "grpc-keepalive": stock gRPC with its own keepalive set as short as the peer timeout
  (TF_GRPC_DEFAULT_OPTIONS, GRPC_KEEPALIVE). The partition fails the coordinator's calls to the
  faulted worker 2.2-2.3 s into it with UnavailableError ("recvmsg:Connection timed out"), a
  worker failure to TensorFlow, which retries the steps on the worker once it answers. The freeze
  failed nothing in our runs: the steps waited for the thaw, as with TensorFlow's settings.
- "rdma": tf_rdma (tcp), TensorFlow's gRPC settings. Every tf_rdma connection to the faulted worker
  (and in the partition the worker's own) fails after the peer timeout, UnavailableError naming the
  peer, and is made again once the peer answers; the frozen worker, running again, is told by the
  ps that it was the silent one. A step that was waiting on one of them fails so, and reaches the
  coordinator through the ps's answer to the worker: TensorFlow alone would count it as a transient
  ps failure (TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES, 3 per ps for the job's life, then raised
  to the user), which gRPC's runs never touch. tf_rdma's ParameterServerStrategy makes it the
  worker's failure (tf_rdma/coordinator_failures.py): the step is retried once the worker answers,
  and no run may count a ps failure. So it does when the partitioned worker's own failure, finding
  the ps silent, comes first: the coordinator finds the ps answering it. The step keeps the ps
  waiting on the worker for most of its time (fault.py), so a fault usually catches a step so.
"""
import json
import re
import signal
import subprocess
import time

import pytest

from tests.harness import netns
from tests.harness.chaos import HANDLING
from tests.tf.programs.cluster import PROGRAMS, NamespacedCluster

PROGRAM = PROGRAMS / "fault.py"
PEER_TIMEOUT_S = 2.0
FAULT_S = 2.5 * PEER_TIMEOUT_S
# From a fault to tf_rdma's connection failing, beyond the peer timeout (which runs from the last
# byte received, before the fault): the heartbeat's timer and a busy machine's scheduling.
SLACK_S = 1.0
FAULTED, HEALTHY = 0, 1
# TensorFlow's start-up on four tasks of a busy 2-core machine, and the steps each worker does
# before the first fault (its first steps trace and place the function).
START_S, WARM_STEPS = 180.0, 40
# From a fault's end to the faulted worker's next step: TCP's backed-off retransmission (up to
# about the fault's length) and a new tf_rdma connection.
REUSE_S = 30.0
# The longest the healthy worker may go without a step, fault or not: the coordinator is stuck.
STALL_S = 5.0
# gRPC's keepalive as short as the peer timeout: a ping a second, the channel failed when 2 s pass
# without its answer, on calls in flight or not.
GRPC_KEEPALIVE = ("grpc.keepalive_time_ms=1000,grpc.keepalive_timeout_ms=2000,"
                  "grpc.keepalive_permit_without_calls=1,grpc.http2.max_pings_without_data=0")
RUNS = {"grpc": ("grpc", {}), "grpc-keepalive": ("grpc", {"TF_GRPC_DEFAULT_OPTIONS": GRPC_KEEPALIVE}),
        "rdma": ("rdma", {})}
VERBOSE = {"TF_CPP_MIN_LOG_LEVEL": "0"}  # tf_rdma's C++ warnings (a connection lost), time-stamped
TASKS = {"chief0": "/job:chief/replica:0/task:0", "ps0": "/job:ps/replica:0/task:0",
         "worker0": "/job:worker/replica:0/task:0", "worker1": "/job:worker/replica:0/task:1"}
# stream_connection.cc's warning as absl writes it: "W0000 00:00:1796288278.138544  8278 ...".
CONNECTION_CLOSED = re.compile(r"^W\d{4} \d\d:\d\d:(\d+\.\d+) .*tf_rdma: tcp connection to (\S+) at \S+ "
                               r"closed: (\w+): (.*)$", re.MULTILINE)
# cluster_coordinator.py's logging.error of a failure, up to the next line of the log's own.
FAILURE = re.compile(r"^ERROR:tensorflow:.*? failed with (\w+)\(\):(.*?)(?=^progress |^[A-Z]+:|^[IWEF]\d{4} |\Z)",
                     re.MULTILINE | re.DOTALL)

NEEDS = netns.unavailable_reason("each task runs in its own network namespace, faults are nftables rules")
pytestmark = pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")


class Progress:
    """The coordinator's "progress" lines."""

    def __init__(self, cluster):
        self.cluster = cluster

    def lines(self):
        found = []
        for line in self.cluster.log("chief", 0).splitlines():
            if line.startswith("progress {"):
                try:
                    found.append(json.loads(line.split(" ", 1)[1]))
                except ValueError:  # a C++ log line written into the middle of it
                    pass
        return found

    def wait_until(self, done, within, what):
        """The first line from now on for which `done(line)` holds; fails naming `what` if none
        comes `within` seconds (the coordinator stuck) or the coordinator exits."""
        deadline = time.monotonic() + within
        seen = len(self.lines())
        while True:
            lines = self.lines()
            for line in lines[seen:]:
                if done(line):
                    return line
            seen = len(lines)
            assert time.monotonic() < deadline, (what, self.cluster.log("chief", 0)[-4000:])
            assert self.cluster.processes[("chief", 0)].poll() is None, self.cluster.log("chief", 0)[-4000:]
            time.sleep(0.1)


def longest_stall(lines, worker, start, end):
    """The longest time between `worker`'s steps from `start` to `end` (the lines' clock)."""
    times = [start] + [b["time"] for a, b in zip(lines, lines[1:])
                       if start <= b["time"] <= end and b["by_worker"][worker] > a["by_worker"][worker]] + [end]
    return max(b - a for a, b in zip(times, times[1:]))


def connections_closed(log):
    """tf_rdma's connections this task lost: [(time, peer, status code, message)]."""
    return [(float(t), peer, code, message) for t, peer, code, message in CONNECTION_CLOSED.findall(log)]


def failures_recovered(log):
    """What TensorFlow's coordinator logged of each failure it recovered from ("Remote function on
    worker ... failed with UnavailableError(): ... It is treated as a transient connectivity
    failure for now.", "Worker ... failed with ..."): [{"class", "handling", "cause", "after"}],
    the cause being tf_rdma's line if any, "after" the time of the progress line before it."""
    found = []
    for match in FAILURE.finditer(log):
        lines = match.group(0).splitlines()
        progress = [line for line in log[:match.start()].splitlines() if line.startswith("progress {")]
        try:
            after = json.loads(progress[-1].split(" ", 1)[1])["time"]
        except (IndexError, ValueError):  # none yet, or torn by a C++ log line
            after = None
        found.append({"class": match.group(1),
                      "handling": next((h for words, h in HANDLING if words in match.group(0)), "handling not known"),
                      "cause": next((line for line in lines if line.startswith("tf_rdma:")), lines[0])[:600],
                      "after": after})
    return found


def play(tmp_path, name):
    """Both faults in the run `name` of RUNS; what the coordinator and, over tf_rdma, each task saw."""
    transport, settings = RUNS[name]
    directory = tmp_path / name
    directory.mkdir()
    env = {"TF_RDMA_PEER_TIMEOUT_MS": str(int(PEER_TIMEOUT_S * 1000)), "TF_RDMA_BACKEND": "tcp", **settings}
    output = directory / "outcome.json"
    record = {"faults": {}}
    with netns.Network() as net, \
            NamespacedCluster(directory, net, {"chief": 1, "ps": 1, "worker": 2}, env) as cluster:
        stats = {}
        for job, index in (("ps", 0), ("worker", FAULTED), ("worker", HEALTHY)):
            if transport == "rdma":
                stats[f"{job}{index}"] = str(directory / f"{job}{index}-stats.json")
            cluster.start(job, index, "serve", transport=transport, stats_file=stats.get(f"{job}{index}"),
                          env=VERBOSE)
        chief = cluster.start("chief", 0, "through_worker_faults", program=PROGRAM, transport=transport,
                              output=str(output), stdin=subprocess.PIPE, env=VERBOSE)
        progress = Progress(cluster)
        progress.wait_until(lambda p: min(p["by_worker"]) >= WARM_STEPS, START_S, "both workers training")
        record["started"] = time.time()
        faulted, others = cluster.host("worker", FAULTED), (cluster.host("chief", 0), cluster.host("ps", 0))
        faults = {
            "partition": (lambda: [net.partition(faulted, other) for other in others],
                          lambda: [net.heal(faulted, other) for other in others]),
            "freeze": (lambda: cluster.signal("worker", FAULTED, signal.SIGSTOP),
                       lambda: cluster.signal("worker", FAULTED, signal.SIGCONT)),
        }
        for fault, (apply, lift) in faults.items():
            before = progress.lines()[-1]
            applied = time.time()
            apply()
            time.sleep(FAULT_S)
            during = progress.lines()[-1]
            lifted = time.time()
            lift()
            back = progress.wait_until(lambda p: p["by_worker"][FAULTED] > during["by_worker"][FAULTED],
                                       REUSE_S, f"worker {FAULTED} used again after the {fault}")
            progress.wait_until(lambda p: p["by_worker"][FAULTED] >= back["by_worker"][FAULTED] + WARM_STEPS,
                                REUSE_S, f"worker {FAULTED} training again after the {fault}")
            record["faults"][fault] = {
                "applied": applied, "lifted": lifted, "reused_after_s": back["time"] - lifted,
                "healthy_steps_during": during["by_worker"][HEALTHY] - before["by_worker"][HEALTHY]}
        stopped = time.time()
        chief.stdin.write(b"stop\n")
        chief.stdin.flush()
        assert cluster.wait("chief", 0, timeout=60) == 0, cluster.log("chief", 0)[-4000:]
        record["outcome"] = json.loads(output.read_text())
        record["coordinator_errors"] = failures_recovered(cluster.log("chief", 0))
        lines = progress.lines()
        record["longest_healthy_stall_s"] = longest_stall(lines, HEALTHY, record["started"], stopped)
        if transport == "rdma":
            record["stats"] = {task: cluster.stats_dumped_after(path, stopped) for task, path in stats.items()}
            record["stats"]["chief0"] = record["outcome"].pop("stats")
            # Up to the stop: the coordinator's exit ends every connection to it.
            record["closed"] = {f"{job}{index}": [c for c in connections_closed(cluster.log(job, index))
                                                  if c[0] < stopped]
                                for job, index in cluster.processes}
    return record


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ps_strategy_faults")
    played = {name: play(tmp_path, name) for name in RUNS}
    print(json.dumps(played, indent=1))  # what each did, for the record (pytest -s)
    return played


def test_the_coordinator_keeps_training_on_the_healthy_worker_through_each_fault(runs):
    for name, run in runs.items():
        assert run["longest_healthy_stall_s"] < STALL_S, (name, run)
        for fault, seen in run["faults"].items():
            assert seen["healthy_steps_during"] > 0, (name, fault, seen)


def test_the_faulted_worker_is_used_again_once_healed_or_resumed(runs):
    """Within REUSE_S in every run (play() fails otherwise); over tf_rdma not much later than over
    gRPC, which waits only for TCP."""
    for fault in ("partition", "freeze"):
        stock, ours = (runs[name]["faults"][fault]["reused_after_s"] for name in ("grpc", "rdma"))
        assert ours < stock + PEER_TIMEOUT_S, (fault, stock, ours)


def test_no_step_is_lost_and_every_failure_is_recovered_from_as_over_grpc(runs):
    """The coordinator raised nothing, and the ps counted every step scheduled (a step TensorFlow
    put back after a failure may count twice: its at-least-once). Every failure the coordinator
    recovered from is an UnavailableError naming a task, and a worker's failure, never a ps's;
    TensorFlow's defaults on stock gRPC see none (the module's docstring)."""
    for name, run in runs.items():
        outcome = run["outcome"]
        assert "error" not in outcome, (name, outcome)
        retried = len(run["coordinator_errors"])
        assert outcome["scheduled"] <= sum(outcome["by_worker"]) <= outcome["scheduled"] + retried, (name, run)
        for failure in run["coordinator_errors"]:
            assert failure["class"] == "UnavailableError" and "/job:" in failure["cause"], (name, failure)
            assert failure["handling"] != "handling not known", (name, failure)
            # A ps failure, counted against TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES: only a worker failed.
            assert failure["handling"] != "transient, step retried", (name, failure)
    assert runs["grpc"]["coordinator_errors"] == [], runs["grpc"]["coordinator_errors"]


def test_whatever_waits_on_the_faulted_peer_fails_within_the_peer_timeout_naming_it(runs):
    """Over tf_rdma, for each fault: the ps's connection to the faulted worker, and in the partition
    the faulted worker's to the ps, fail UNAVAILABLE (UnavailableError to what waits on them),
    naming the peer as unresponsive, within the peer timeout plus SLACK_S of the fault. Every
    connection a task lost had the faulted worker at one end. The frozen worker itself judges its
    connections only once it runs again: those the others closed meanwhile fail then ("closed the
    connection", or "unresponsive" if its timer comes first)."""
    run = runs["rdma"]
    expected = {"partition": {("ps0", "worker0"), ("worker0", "ps0")}, "freeze": {("ps0", "worker0")}}
    faulted = TASKS["worker0"]
    detected = {fault: {} for fault in run["faults"]}
    for task, closed in run["closed"].items():
        for at, peer, code, message in closed:
            assert faulted in (TASKS[task], peer), (task, message)
            assert code == "UNAVAILABLE" and f"peer {peer} at " in message, (task, message)
            fault, seen = max(((f, s) for f, s in run["faults"].items() if s["applied"] <= at),
                              key=lambda item: item[1]["applied"], default=(None, None))
            assert fault is not None, ("lost before any fault", task, message)
            if fault == "freeze" and TASKS[task] == faulted:
                assert at >= seen["lifted"], (task, message)
            elif "unresponsive" in message:
                name = next(n for n, t in TASKS.items() if t == peer)
                detected[fault][(task, name)] = at - seen["applied"]
    for fault, failed in detected.items():
        assert expected[fault] <= set(failed), (fault, detected)
        assert max(failed.values()) < PEER_TIMEOUT_S + SLACK_S, (fault, detected)


def test_tf_rdma_reports_no_healthy_peer_dead(runs):
    """Between the coordinator, the ps and the healthy worker, one connection each way of the run,
    no error; none of them lost a connection to anyone but the faulted worker."""
    run = runs["rdma"]
    healthy = ("chief0", "ps0", "worker1")
    for task in healthy:
        for other in healthy:
            peer = run["stats"][task]["peers"].get(TASKS[other])
            if peer is not None:
                assert peer["errors"] == 0 and peer["connects"] == 1, (task, other, peer)
        assert all(peer == TASKS["worker0"] for _, peer, _, _ in run["closed"][task]), run["closed"][task]
