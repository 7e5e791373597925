"""`python -m tf_rdma bench collective`: a short real run (one size, two workers, gRPC and shm in
the same run), and the table's arithmetic on canned figures."""

import pytest

from tests.tf.programs.bench_runs import bench_report
from tf_rdma.bench import collective as bench_collective


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(360)
def test_a_short_run_measures_grpc_and_tf_rdma_side_by_side():
    report, progress = bench_report("collective", "--backend", "shm", "--workers", "2", "--sizes", "64K", timeout=300)
    assert report["unavailable"] == {}
    [row] = report["rows"]
    assert row["workers"] == 2 and row["size"] == 64 << 10
    assert row["grpc_seconds"] > 0 and row["shm_seconds"] > 0 and row["memcpy_seconds"] > 0
    assert row["vs_grpc_shm"] == row["grpc_seconds"] / row["shm_seconds"]
    assert "all-reduce, 2 workers, grpc" in progress and "all-reduce, 2 workers, shm" in progress


def test_the_table_shows_milliseconds_and_the_ratio_to_grpc():
    report = {"unavailable": {"verbs": "no RDMA device"}, "rows": [
        {"workers": 2, "size": 64 << 20, "memcpy_seconds": 0.0125, "grpc_seconds": 0.6,
         "tcp_seconds": 0.3, "vs_grpc_tcp": 2.0, "shm_seconds": 0.2, "vs_grpc_shm": 3.0}]}
    text = bench_collective.render(report)
    assert "verbs: unavailable: no RDMA device" in text
    assert "       2   64 MiB   12.500   600.00   300.00   2.00   200.00   3.00" in text


def test_ratio_is_grpc_time_over_tf_rdma_time():
    assert bench_collective.ratios(0.6, 0.2) == pytest.approx(3.0)
    assert bench_collective.ratios(0.6, 0.0) is None
