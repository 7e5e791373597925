"""`python -m tf_rdma bench scale --quick`: a real run over shm with gRPC beside it, checked for its
structure and arithmetic (not for speed)."""

import pytest

from bench_runs import bench_report, check_png
from tf_rdma import bench_scale


@pytest.mark.timeout(200)
def test_a_quick_run_reports_every_figure_consistently(tmp_path):
    plot = tmp_path / "scale.png"
    report, progress = bench_report("scale", "--quick", "--backend", "shm", "--plot", str(plot), timeout=180)
    assert report["backends"] == ["shm"] and report["unavailable"] == {}
    assert [r["peers"] for r in report["transport"]] == list(bench_scale.QUICK["peers"])
    for row in report["transport"]:
        assert row["fairness"] == pytest.approx(row["min_bytes"] / row["max_bytes"])
        assert row["min_bytes"] > 0 and row["throughput_gbps"] > 0 and row["connect_seconds"] > 0
        # Every idle peer holds its connection's descriptor in the receiver.
        assert row["per_idle_peer"]["fds"] >= 1, row
    largest = report["transport"][-1]
    assert report["extrapolated"]["shm"]["10000"]["fds"] == pytest.approx(
        largest["before"]["fds"] + largest["per_idle_peer"]["fds"] * 10000)
    for transport in ("grpc", "shm"):
        rows = report["tf"][transport]
        assert [r["workers"] for r in rows] == list(bench_scale.QUICK["workers"])
        assert all(r["ps_threads"] > 0 and r["steps_per_second"] > 0 for r in rows), rows
    assert "shm: 8 peers" in progress and "workers over grpc" in progress  # progress lines
    check_png(plot)
