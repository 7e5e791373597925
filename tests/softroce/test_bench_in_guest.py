"""`python -m tf_rdma bench transport --backend verbs --json`, run for real in the Soft-RoCE guest.

Checks that the verbs bench runs over the guest's RDMA device and that perftest's ib_write_bw /
ib_write_lat ran on that device in the same run, with the settings the comparison depends on, for
every size and round. The figures themselves are TCG timing, too noisy for a performance bar; the
arithmetic that turns them into the README's ratios is unit-tested on canned output
(tests/test_bench.py).

Skipped when the harness's host packages are missing, unless CI is set: then it fails
(tests/softroce/conftest.py).
"""

import json
import re

import pytest

from tests.softroce.guest_loader import PYTHON, REPO


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(400)
def test_verbs_bench_compares_with_perftest_on_the_same_device(softroce):
    res = softroce.run(
        [PYTHON, "-m", "tf_rdma", "bench", "transport", "--backend", "verbs", "--host", softroce.GUEST_IP,
         "--json", "--sizes", "64K,1M", "--bytes-per-size", str(4 << 20), "--latency-sizes", "8,4K",
         "--round-trips", "50", "--rounds", "2", "--verbs-poll-us", "0,1000"],
        timeout=300, cwd=str(REPO))
    assert res.returncode == 0, res.output
    # The JSON is the last thing printed; anything before it is logging.
    start = re.search(r"^\{$", res.output, re.M)
    assert start, res.output
    report = json.loads(res.output[start.start():])["verbs"]
    assert "unavailable" not in report, report

    perftest = report["perftest"]
    assert perftest["available"], perftest
    assert perftest["errors"] == [], perftest["errors"]
    assert perftest["device"] == softroce.GUEST_RDMA_DEVICE, perftest
    assert perftest["device_chosen_by"], perftest
    assert report["rounds"] == 2

    assert [row["size"] for row in report["throughput"]] == [64 << 10, 1 << 20]
    # Each latency size once per poll window, both measured in every round beside ib_write_lat.
    assert [(row["size"], row["poll_us"]) for row in report["latency"]] == \
        [(8, 0), (4 << 10, 0), (8, 1000), (4 << 10, 1000)]
    for row in report["throughput"]:
        measured = perftest["ib_write_bw"][str(row["size"])]
        # perftest's own header says it kept as many writes in flight as tf_rdma's grants allow.
        assert measured["tx_depth"] == perftest["grant_depth"], measured
        assert len(measured["rounds_gbps"]) == 2 and None not in measured["rounds_gbps"], measured
        assert all(r["vs_ib_write_bw"] is not None for r in row["rounds"]), row
    for row in report["latency"]:
        measured = perftest["ib_write_lat"][str(row["size"])]
        assert len(measured["rounds_avg_us"]) == 2 and None not in measured["rounds_avg_us"], measured
        assert all(r["vs_ib_write_lat"] is not None for r in row["rounds"]), row
        assert all(r["transport_cpu_percent"] > 0 for r in row["rounds"]), row
