"""`python -m tf_rdma bench chaos`, short: ParameterServerStrategy training through a killed and
restarted worker, a frozen one, a short and a long partition between a worker and a ps, and a
spell of 1% loss, over gRPC and tf_rdma (tcp) under the same seeded schedule (tf_rdma/bench_chaos.py)."""
import json
import subprocess
import sys

import pytest

from tf_rdma import bench_chaos, netns

NEEDS = netns.unavailable_reason("each task of the chaos run gets a network namespace of its own")
MINUTES = 0.75
FAULTS = {"kill", "freeze", "short_partition", "long_partition", "loss"}


@pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")
@pytest.mark.timeout(900)
def test_a_short_chaos_run_recovers_without_a_hang_a_lost_step_or_growth():
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "bench", "chaos", "--minutes", str(MINUTES),
                             "--json"], capture_output=True, text=True, timeout=850)
    assert result.stdout, result.stderr[-3000:]
    report = json.loads(result.stdout)
    print(bench_chaos.render(report))  # the table, for the record (pytest -s)
    assert {e["fault"] for e in report["schedule"]} == FAULTS
    stock, ours = report["runs"]
    assert [r["transport"] for r in report["runs"]] == ["grpc", "tcp"]
    assert not ours["hang"] and ours["error"] is None, ours
    assert ours["lost_steps"] == 0 and ours["steps_after_last_fault"] > 0, ours
    assert ours["flat"], ours["flatness"]
    # Every failure TensorFlow recovered from is one a lost worker or ps link makes, and tf_rdma's
    # name the peer.
    classes = {error.split()[0] for error in ours["errors"]}
    assert classes <= {"UnavailableError", "AbortedError", "CancelledError"}, ours["errors"]
    for entry in ours["errors"].values():
        assert "/job:" in entry["example"], entry
    # Training went on through the faults as over gRPC: both models learned, to comparable losses.
    for run in (stock, ours):
        assert "final_loss" in run and run["final_loss"] < 0.5 * run["initial_loss"], run
    assert report["final_loss_vs_grpc"] < 2.0, report["final_loss_vs_grpc"]
    assert report["ok"] and result.returncode == 0, result.stderr[-3000:]


def test_the_schedule_is_the_seeds_one_fault_of_each_kind_apart_in_the_first_three_quarters():
    events = bench_chaos.schedule(7, 180, 2.0)
    assert events == bench_chaos.schedule(7, 180, 2.0) != bench_chaos.schedule(8, 180, 2.0)
    assert sorted(e["fault"] for e in events) == sorted(FAULTS)
    for before, after in zip(events, events[1:]):
        assert before["at"] + before["seconds"] <= after["at"], events
    assert events[-1]["at"] + events[-1]["seconds"] <= 0.75 * 180
    with pytest.raises(bench_chaos.ChaosError, match="--minutes"):
        bench_chaos.schedule(7, 20, 2.0)  # 3 s per fault, the long partition lasts 5


# What TensorFlow 2.21's cluster_coordinator logs (tasks run with "%(levelname)s %(message)s").
COORDINATOR_LOG = """INFO Waiting for all global closures to be finished.
ERROR Remote function on worker /job:worker/replica:0/task:1 failed with UnavailableError():Graph execution error:

Detected at node ...
tf_rdma: receiving 'edge_45' from task /job:ps/replica:0/task:1 failed: peer /job:ps/replica:0/task:1 is unresponsive
Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling Enqueue:
It is treated as a transient connectivity failure for now.
INFO Worker /job:worker/replica:0/task:1 calling on_recovery_fn
ERROR Worker /job:worker/replica:0/task:0 failed with UnavailableError():Socket closed
Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling Enqueue:
ERROR Worker /job:worker/replica:0/task:2 failed with UnavailableError():Socket closed
"""


def test_the_coordinators_failures_are_counted_by_class_and_handling_with_their_cause():
    seen = bench_chaos._errors_seen(COORDINATOR_LOG)
    assert seen.keys() == {"UnavailableError (transient, step retried)",
                           "UnavailableError (worker failure, steps retried once it is back)"}
    transient = seen["UnavailableError (transient, step retried)"]
    assert transient["count"] == 1 and transient["example"].startswith("tf_rdma: receiving 'edge_45'")
    worker = seen["UnavailableError (worker failure, steps retried once it is back)"]
    assert worker["count"] == 2 and "/job:worker/replica:0/task:0" in worker["example"]
