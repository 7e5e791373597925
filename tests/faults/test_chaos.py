"""`python -m tf_rdma bench chaos`, short: ParameterServerStrategy training through a killed and
restarted worker, a frozen one, a short and a long partition between a worker and a ps, and a
spell of 1% loss, over gRPC and tf_rdma (tcp) under the same seeded schedule (tf_rdma/bench_chaos.py)."""
import json
import subprocess
import sys

import pytest

from tf_rdma import bench_chaos, netns

NEEDS = netns.unavailable_reason("each task of the chaos run gets a network namespace of its own")
pytestmark = pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")
MINUTES = 0.75
FAULTS = {"kill", "freeze", "short_partition", "long_partition", "loss"}


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
