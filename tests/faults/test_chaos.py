"""`python -m tests.harness chaos`, short: ParameterServerStrategy training through a killed and
restarted worker, a frozen one, a short and a long partition between a worker and a ps, and a
spell of every link impaired (1% loss, 20 ± 5 ms delay, 1% duplication), over gRPC and tf_rdma
(tcp) under the same seeded schedule (tests/harness/chaos.py)."""
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import REPO
from tests.harness import chaos, flatness, netns

NEEDS = netns.unavailable_reason("each task of the chaos run gets a network namespace of its own")
MINUTES = 0.75
FAULTS = {"kill", "freeze", "short_partition", "long_partition", "impairment"}
# The run's bound, under the test's: then SIGINT, and the run has CLEANUP_S to stop its tasks
# and delete its namespaces (a SIGKILL would leave them) before it is killed.
RUN_S, CLEANUP_S = 780, 60


def run_chaos():
    """(exit status, stdout, stderr) of `python -m tests.harness chaos --json`, or the test fails with
    their tails once it ran longer than RUN_S; no namespace of the run's is left either way."""
    harness = subprocess.Popen([sys.executable, "-m", "tests.harness", "chaos", "--minutes", str(MINUTES),
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = harness.communicate(timeout=RUN_S)
        overran = None
    except subprocess.TimeoutExpired:
        harness.send_signal(signal.SIGINT)
        try:
            out, err = harness.communicate(timeout=CLEANUP_S)
            overran = f"ran over {RUN_S} s; stopped by SIGINT"
        except subprocess.TimeoutExpired:
            harness.kill()
            out, err = harness.communicate(timeout=30)
            overran = f"ran over {RUN_S} s and did not end {CLEANUP_S} s after SIGINT; killed"
    left = {n for n in netns.namespaces() if n.startswith(f"tfrf{harness.pid}n")}
    assert not overran and not left, (f"the chaos run {overran or 'ended'}; namespaces left: {sorted(left)}\n"
                                      f"stdout ends:\n{out[-2000:]}\nstderr ends:\n{err[-4000:]}")
    return harness.returncode, out, err


@pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")
@pytest.mark.timeout(RUN_S + CLEANUP_S + 60)
def test_a_short_chaos_run_recovers_without_a_hang_a_lost_step_or_growth():
    status, out, err = run_chaos()
    try:
        report = json.loads(out)
    except json.JSONDecodeError:
        pytest.fail(f"the chaos run exited {status} without its report; stderr ends:\n{err[-4000:]}")
    print(chaos.render(report))  # the table, for the record (pytest -s)
    assert {e["fault"] for e in report["schedule"]} == FAULTS
    stock, ours = report["runs"]
    assert [r["transport"] for r in report["runs"]] == ["grpc", "tcp"]
    assert not ours["hang"] and ours["error"] is None, ours
    assert ours["lost_steps"] == 0 and ours["steps_after_last_fault"] > 0, ours
    assert ours["flat"], ours["flatness"]
    # Every failure TensorFlow recovered from is one a lost worker or ps link makes, and tf_rdma's
    # name the peer (the others are the coordinator's own calls, on gRPC).
    classes = {error.split()[0] for error in ours["errors"]}
    assert classes <= {"UnavailableError", "AbortedError", "CancelledError"}, ours["errors"]
    for entry in ours["errors"].values():
        assert "tf_rdma:" not in entry["example"] or "/job:" in entry["example"], entry
    # Training went on through the faults as over gRPC: both models learned, to comparable losses.
    for run in (stock, ours):
        assert "final_loss" in run and run["final_loss"] < 0.5 * run["initial_loss"], run
    assert report["final_loss_vs_grpc"] < 2.0, report["final_loss_vs_grpc"]
    assert report["ok"] and status == 0, err[-3000:]


def test_the_schedule_is_the_seeds_one_fault_of_each_kind_apart_in_the_first_three_quarters():
    events = chaos.schedule(7, 180, 2.0)
    assert events == chaos.schedule(7, 180, 2.0) != chaos.schedule(8, 180, 2.0)
    assert sorted(e["fault"] for e in events) == sorted(FAULTS)
    for before, after in zip(events, events[1:]):
        assert before["at"] + before["seconds"] <= after["at"], events
    assert events[-1]["at"] + events[-1]["seconds"] <= 0.75 * 180
    with pytest.raises(chaos.ChaosError, match="--minutes"):
        chaos.schedule(7, 20, 2.0)  # 3 s per fault, the long partition lasts 5


# What TensorFlow 2.21's cluster_coordinator logs (tasks run with chaos.TASK_LOG_FORMAT), between
# C++ lines (TensorFlow's and tf_rdma's, absl's format).
COORDINATOR_LOG = """1796236590.000001 INFO Waiting for all global closures to be finished.
1796236590.500000 ERROR Remote function on worker /job:worker/replica:0/task:2 failed with UnavailableError():Socket closed
It is treated as a transient connectivity failure for now.
1796236590.750000 ERROR Remote function on worker /job:worker/replica:0/task:2 failed with UnavailableError():Graph execution error:

Detected at node mul_1/_6 defined at (most recent call last):
<stack traces unavailable>
Additional GRPC error information from remote target /job:ps/replica:0/task:1 while calling RunComponentFunction:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:" tf_rdma: receiving 'edge_35_mul_1' from task /job:worker/replica:0/task:2 failed"}
It is treated as a transient connectivity failure for now.
1796236591.250000 ERROR Remote function on worker /job:worker/replica:0/task:1 failed with UnavailableError():Graph execution error:

Detected at node ...
tf_rdma: receiving 'edge_45' from task /job:ps/replica:0/task:1 failed: peer /job:ps/replica:0/task:1 is unresponsive
Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling Enqueue:
It is treated as a transient connectivity failure for now.
1796236591.250300 INFO Worker /job:worker/replica:0/task:1 calling on_recovery_fn
1796236600.000100 ERROR Worker /job:worker/replica:0/task:0 failed with UnavailableError():Socket closed
Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling Enqueue:
I0000 00:00:1796236600.123456   16220 runtime.cc:371] tf_rdma: tcp to task /job:worker/replica:0/task:0 at 10.213.0.4:2222
1796236601.000000 ERROR Worker /job:worker/replica:0/task:2 failed with UnavailableError():Socket closed
"""


def test_the_coordinators_failures_are_counted_by_class_and_handling_with_their_cause():
    seen = chaos._errors_seen(COORDINATOR_LOG)
    assert seen.keys() == {"UnavailableError (transient, step retried)",
                           "UnavailableError (worker failure, steps retried once it is back)"}
    transient = seen["UnavailableError (transient, step retried)"]
    # tf_rdma's words where any occurrence has them, the first such, found inside gRPC's too.
    assert transient["count"] == 3 and transient["example"].startswith(
        "tf_rdma: receiving 'edge_35_mul_1' from task /job:worker/replica:0/task:2"), transient
    worker = seen["UnavailableError (worker failure, steps retried once it is back)"]
    # The message ends where the next line of a log begins, a C++ one too.
    assert worker["count"] == 2 and worker["example"] == (
        "Socket closed Additional GRPC error information from remote target /job:worker/replica:0/task:0 "
        "while calling Enqueue:"), worker


# ---- the driver, without TensorFlow: each task is `sleep` in its namespace ----

def ours():
    """This process's namespaces (every name carries its id): another run's are not ours."""
    return {n for n in netns.namespaces() if n.startswith(f"tfrf{os.getpid()}n")}


def fake_tasks(monkeypatch, chief_lines=(), fail_at=None):
    """Starts the chaos run's tasks as `sleep` in their namespaces (so stop, kill, freeze and the
    samples act on real processes), the chief first printing `chief_lines`; the `fail_at`-th start
    raises. Returns the processes started."""
    started = []

    def start_task(module, spec, stderr, env, prefix):
        if len(started) + 1 == fail_at:
            raise OSError(f"injected: task {len(started) + 1} cannot start")
        lines = chief_lines if spec["job"] == "chief" else ()
        script = "".join(f"echo {shlex.quote(line)}; " for line in lines) + "exec sleep 600"
        started.append(subprocess.Popen([*prefix, "sh", "-c", script], stdout=subprocess.PIPE, stderr=stderr,
                                        text=True))
        return started[-1]
    monkeypatch.setattr(flatness, "start_task", start_task)
    return started


def a_round(completed=30):
    return chaos.PROGRESS_PREFIX + json.dumps({"time": time.time(), "completed": completed})


def run_fake(tmp_path, events, unfaulted_seconds=0.0, progress=None):
    return chaos.run_transport("grpc", 60, unfaulted_seconds, events, 2.0, str(tmp_path), progress)


def report_of(run, events):
    """chaos.run's report of `run` over both transports, for render()."""
    return {"backend": "tcp", "seed": 1, "minutes": 1, "unfaulted_seconds": 0, "peer_timeout_ms": 2000,
            "schedule": events, "runs": [run, {**run, "transport": "tcp"}], "final_loss_vs_grpc": None, "ok": False}


needs_root = pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")


@needs_root
def test_a_task_that_cannot_start_stops_those_started_and_deletes_the_network(monkeypatch, tmp_path):
    started = fake_tasks(monkeypatch, fail_at=4)
    with pytest.raises(OSError, match="injected"):
        run_fake(tmp_path, [])
    assert len(started) == 3 and all(p.returncode == -signal.SIGKILL for p in started)
    assert not ours()


@needs_root
def test_an_interrupt_stops_every_task_a_frozen_one_too(monkeypatch, tmp_path):
    started = fake_tasks(monkeypatch, [a_round()])

    def progress(text):
        if "freeze" in text:
            raise KeyboardInterrupt  # ^C once the worker is frozen
    with pytest.raises(KeyboardInterrupt):
        run_fake(tmp_path, [{"at": 0, "fault": "freeze", "target": "worker1", "seconds": 30}], progress=progress)
    assert len(started) == 6 and all(p.returncode == -signal.SIGKILL for p in started)
    assert not ours()


@needs_root
def test_the_watchdog_names_the_round_the_fault_in_flight_and_the_logs(monkeypatch, tmp_path):
    monkeypatch.setattr(chaos, "WATCHDOG_SLACK_S", 0.3)
    started = fake_tasks(monkeypatch, [a_round()])  # then nothing: the second round hangs
    # In flight from 1.2 s to 3.2 s after the round; the watchdog fires 2.3 s after it (the longest
    # fault and the slack): about a second either side for a loaded machine's stalls.
    events = [{"at": 1.2, "fault": "short_partition", "target": ["worker0", "ps0"], "seconds": 2.0}]
    run = run_fake(tmp_path, events)
    hang = run["hang"]
    assert hang["round"] == 2 and hang["phase"] == "faults", hang
    assert [e["fault"] for e in hang["active_faults"]] == ["short_partition"], hang
    assert hang["active_faults"][0]["applied_at"] <= hang["at"], hang
    assert sorted(hang["logs"]) == sorted(["chief", "ps0", "ps1", "worker0", "worker1", "worker2"])
    assert all(os.path.exists(log) for log in hang["logs"].values()), hang["logs"]
    assert all(p.returncode == -signal.SIGKILL for p in started) and not ours()
    text = chaos.render(report_of(run, events))
    assert "gRPC hung in round 2 (faults phase)" in text and "short_partition worker0 <-> ps0" in text, text
    assert hang["logs"]["worker0"] in text, text


@needs_root
def test_an_error_before_the_faults_is_reported_as_such(monkeypatch, tmp_path):
    error = {"class": "InvalidArgumentError", "message": "no such device"}
    started = fake_tasks(monkeypatch, [a_round(), chaos.DONE_PREFIX + json.dumps(
        {"completed": 30, "error": error, "initial_loss": 1.0})])
    events = [{"at": 0, "fault": "impairment", "target": None, "seconds": 5}]
    run = run_fake(tmp_path, events, unfaulted_seconds=60)
    assert run["error"] == {**error, "phase": "unfaulted"} and not run["hang"], run
    assert "chaos_steps" not in run and "flat" not in run, run  # no figure of a fault's outcome
    assert all(p.returncode == -signal.SIGKILL for p in started) and not ours()
    text = chaos.render(report_of(run, events))
    assert "InvalidArgumentError (before faults)" in text, text
    assert "raised InvalidArgumentError in the unfaulted phase (before any fault" in text, text


# ---- the flatness judgement: what TensorFlow keeps for a cluster update is not tf_rdma's ----

def run_with_growth(updates, **growth):
    """A run's flatness over SETTLE samples before the faults and SETTLE at the end: every process
    flat but for `growth` ({"PROCESS_QUANTITY": amount}); `updates` cluster updates."""
    start = {"rss_bytes": 600 << 20, "fds": 30, "threads": 110}
    end = {p: {q: v + growth.get(f"{p}_{q}", 0) for q, v in start.items()} for p in chaos.LONG_LIVED}
    samples = ([{p: dict(start) for p in chaos.LONG_LIVED}] * flatness.SETTLE
               + [end] * flatness.SETTLE)
    return {"flatness": flatness.judge(samples, 0, chaos.GROWTH_BOUNDS, chaos.LONG_LIVED),
            "cluster_updates": updates}


def judged(ours, grpc):
    chaos._judge_against(ours, grpc)
    return {f"{p}_{q}" for p, quantities in ours["flatness"].items() for q, v in quantities.items() if not v["flat"]}


# What TensorFlow kept over gRPC in a run of this schedule with one cluster update (the killed
# worker's recovery): 4 eager client threads on the chief and on each ps, 36 MiB on the chief.
TENSORFLOWS = {"chief_threads": 4, "ps0_threads": 4, "ps1_threads": 4, "chief_rss_bytes": 36 << 20}


def test_tensorflows_threads_and_memory_per_cluster_update_are_not_tf_rdmas_growth():
    assert judged(run_with_growth(1, **TENSORFLOWS), run_with_growth(1, **TENSORFLOWS)) == set()
    # Around the update gRPC's run ended a thread on the coordinator and started one on ps 0: the
    # threads TensorFlow keeps per update are the most any process grew.
    assert judged(run_with_growth(1, **TENSORFLOWS),
                  run_with_growth(1, **{**TENSORFLOWS, "chief_threads": 3, "ps0_threads": 5})) == set()
    # tf_rdma's run made two updates (a frozen worker failed over tf_rdma, not over gRPC): twice it.
    assert judged(run_with_growth(2, **{k: 2 * v for k, v in TENSORFLOWS.items()}),
                  run_with_growth(1, **TENSORFLOWS)) == set()


def test_a_thread_or_memory_tf_rdma_keeps_beside_tensorflows_is_growth():
    # One thread more than TensorFlow's on a ps, or on the coordinator.
    assert judged(run_with_growth(1, **{**TENSORFLOWS, "chief_threads": 5}),
                  run_with_growth(1, **TENSORFLOWS)) == {"chief_threads"}
    assert judged(run_with_growth(1, **{**TENSORFLOWS, "ps0_threads": 5}),
                  run_with_growth(1, **TENSORFLOWS)) == {"ps0_threads"}
    # TensorFlow's threads with no cluster update of tf_rdma's run to account for them.
    assert judged(run_with_growth(0, **TENSORFLOWS), run_with_growth(1, **TENSORFLOWS)) == {
        "chief_threads", "ps0_threads", "ps1_threads", "chief_rss_bytes"}
    # 8 KiB per step over about 4,500 steps on a ps; a descriptor on the chief.
    assert judged(run_with_growth(1, **TENSORFLOWS, ps1_rss_bytes=4500 * 8 << 10, chief_fds=1),
                  run_with_growth(1, **TENSORFLOWS)) == {"ps1_rss_bytes", "chief_fds"}


def test_the_coordinator_trains_on_until_its_cluster_updates_settle():
    now = [100.0]
    updates = chaos.ClusterUpdates(clock=lambda: now[0])
    coordinator = logging.getLogger("test_chaos.coordinator")
    coordinator.addHandler(updates)
    try:
        assert updates.settled(8.0) and updates.begun == 0
        coordinator.warning("Waiting for all global closures to be finished.")
        coordinator.warning(chaos.CLUSTER_UPDATE_BEGINS)
        now[0] += 30
        assert not updates.settled(8.0)  # under way
        coordinator.warning("Cluster successfully recovered.")
        now[0] += 7.9
        assert not updates.settled(8.0)  # the end samples could still precede it
        now[0] += 0.2
        assert updates.settled(8.0) and updates.begun == 1
        coordinator.warning(chaos.CLUSTER_UPDATE_BEGINS)
        coordinator.warning("Error occurred while updating server def: %s", "unavailable")
        now[0] += 8.1
        assert updates.settled(8.0) and updates.begun == 2
    finally:
        coordinator.removeHandler(updates)


def started_thread(name=None):
    """A thread of this process that lives until the returned event is set, named `name` (as gRPC
    names its event-engine pool's, in /proc) if given."""
    stop, named = threading.Event(), threading.Event()

    def body():
        if name:
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(name)
        named.set()
        stop.wait()
    threading.Thread(target=body, daemon=True).start()
    named.wait()
    return stop


def test_grpcs_event_engine_pool_threads_are_sampled_apart_and_any_other_thread_is_growth():
    pid = os.getpid()
    before = [{"chief": chaos._sample(pid)}] * flatness.SETTLE
    pool = started_thread(chaos.GRPC_POOL_THREAD)  # its lifeguard started one under a backlog
    try:
        after = [{"chief": chaos._sample(pid)}] * flatness.SETTLE
        verdict = flatness.judge(before + after, 0, chaos.GROWTH_BOUNDS, ("chief",))
        assert verdict["chief"]["threads"]["growth"] == 0, verdict
        assert after[0]["chief"]["grpc_pool_threads"] == before[0]["chief"]["grpc_pool_threads"] + 1
        # Counted as flatness.process_sample counts them, the pool's thread was growth: the judgement failed.
        assert flatness.process_sample(pid)["threads"] == after[0]["chief"]["threads"] + after[0]["chief"][
            "grpc_pool_threads"]
        kept = started_thread()  # a thread tf_rdma would keep: named after its starter's
        try:
            end = [{"chief": chaos._sample(pid)}] * flatness.SETTLE
            verdict = flatness.judge(before + end, 0, chaos.GROWTH_BOUNDS, ("chief",))
            assert verdict["chief"]["threads"]["growth"] == 1 and not verdict["chief"]["threads"]["flat"], verdict
        finally:
            kept.set()
    finally:
        pool.set()
