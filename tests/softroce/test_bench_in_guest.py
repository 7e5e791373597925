"""`python -m tf_rdma bench transport --backend verbs --json`, run for real in the Soft-RoCE guest.

Checks that the verbs bench runs over rxe0 and reports perftest's ib_write_bw / ib_write_lat, run
on the same device in the same run, and tf_rdma's ratios to them, as medians over interleaved
rounds with their spread. Sizes are small, so the whole test (boot included) takes well under three
minutes; the ratios are only checked to be positive, since TCG timing is too noisy for a
performance bar in CI.

Skipped when the harness's host packages are missing, unless CI is set: then it fails
(tests/softroce/conftest.py).
"""

import json
import re

from guest_loader import PYTHON, REPO


def test_verbs_bench_reports_perftest_ratios(softroce):
    res = softroce.run(
        [PYTHON, "-m", "tf_rdma", "bench", "transport", "--backend", "verbs", "--json",
         "--sizes", "64K,1M", "--bytes-per-size", str(4 << 20), "--latency-sizes", "8,4K",
         "--round-trips", "50", "--rounds", "2"],
        timeout=150, env={"TF_RDMA_TEST_HOST": softroce.GUEST_IP}, cwd=str(REPO))
    assert res.returncode == 0, res.output
    # The JSON is the last thing printed; anything before it is logging.
    start = re.search(r"^\{$", res.output, re.M)
    assert start, res.output
    report = json.loads(res.output[start.start():])["verbs"]
    assert "unavailable" not in report, report

    perftest = report["perftest"]
    assert perftest["available"], perftest
    assert perftest["errors"] == [], perftest["errors"]
    assert perftest["device"] == "rxe0" and perftest["gid_index"] == 1, perftest
    assert report["rounds"] == 2

    check_rows(report["throughput"], [64 << 10, 1 << 20], "transport_gbps", "ib_write_bw_gbps", "vs_ib_write_bw")
    for row in report["throughput"]:
        assert perftest["ib_write_bw"][str(row["size"])]["tx_depth"] == perftest["grant_depth"]
        assert len(perftest["ib_write_bw"][str(row["size"])]["rounds_gbps"]) == 2
        assert row["vs_tcp_socket"] > 0 and row["vs_memcpy"] > 0, row
    check_rows(report["latency"], [8, 4 << 10], "transport_us", "ib_write_lat_us", "vs_ib_write_lat")


def check_rows(rows, sizes, ours, perftests, ratio):
    """Every size measured by both, over both rounds, with the median ratio inside its spread."""
    assert [row["size"] for row in rows] == sizes
    for row in rows:
        assert row[ours] > 0 and row[perftests] > 0 and row[ratio] > 0, row
        assert row[f"{ratio}_min"] <= row[ratio] <= row[f"{ratio}_max"], row
        assert len(row["rounds"]) == 2, row
