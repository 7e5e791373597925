"""`python -m tf_rdma bench scale --quick`: a real run over shm with gRPC beside it, checked for its
structure and arithmetic (not for speed); and on canned figures the arithmetic, table and plot,
and what --quick leaves to --peers and --workers."""
import json

import pytest

from tests.tf.programs.bench_runs import bench_report, check_png, check_table_and_plot
from tf_rdma.bench import scale as bench_scale, transport as bench_transport
from tf_rdma.__main__ import main


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


# ---- canned figures: no receiver, no cluster ----

KIB = 1 << 10
START = {"endpoint": "127.0.0.1:1", "threads": 10, "rss": 100 << 20, "vm": 1 << 30, "fds": 20, "mapped": 0}


def receiver_answers(peers):
    """A receiver's answers to `accept` and `flow` with `peers` peers: per idle peer one descriptor,
    64 KiB of RSS and 1 MiB of VM, 8 threads in all; after traffic 96 KiB of RSS and 128 KiB
    mapped per peer; one peer moved half as much as the others."""
    idle = {**START, "threads": 18, "rss": START["rss"] + peers * 64 * KIB, "vm": START["vm"] + peers * (1 << 20),
            "fds": START["fds"] + peers}
    after = {**idle, "rss": START["rss"] + peers * 96 * KIB, "mapped": peers * 128 * KIB}
    return idle, {"bytes": [4 << 20] * (peers - 1) + [2 << 20], "seconds": 2.0, "after": after}


def test_a_row_is_the_receivers_growth_per_peer_its_throughput_and_fairness():
    row = bench_scale.peers_row("shm", 4, 0.5, START, *receiver_answers(4))
    assert row["per_idle_peer"] == {"threads": 2, "rss": 64 * KIB, "vm": 1 << 20, "fds": 1, "mapped": 0}
    assert row["per_peer_after_traffic"]["rss"] == 96 * KIB and row["per_peer_after_traffic"]["mapped"] == 128 * KIB
    assert row["throughput_gbps"] == pytest.approx((3 * (4 << 20) + (2 << 20)) / 2.0 / 1e9)
    assert row["fairness"] == 0.5 and row["min_bytes"] == 2 << 20 and row["max_bytes"] == 4 << 20
    assert row["before"] == {k: START[k] for k in ("threads", "rss", "vm", "fds", "mapped")}


@pytest.fixture
def canned(monkeypatch):
    """bench_scale.run on canned figures; what it asked for, in `asked`."""
    asked = {"peers": [], "workers": []}

    def run_peers(backend, peers, flow_seconds, host):
        asked["peers"].append(peers)
        return bench_scale.peers_row(backend, peers, 0.01 * peers, START, *receiver_answers(peers))

    def run_tf(transport, worker_counts, budget):
        asked["workers"].append(list(worker_counts))
        # The ps: 40 threads and 200 MiB, and 4 threads and 10 MiB more per worker.
        return [{"workers": w, "ps_threads": 40 + 4 * w, "ps_rss": (200 + 10 * w) << 20,
                 "steps_per_second": 100 / w, "steps": 9} for w in sorted(worker_counts)]
    monkeypatch.setattr(bench_scale, "available_backends", lambda: {"shm": None, "verbs": "no RDMA device"})
    monkeypatch.setattr(bench_scale, "run_peers", run_peers)
    monkeypatch.setattr(bench_scale, "run_tf", run_tf)
    monkeypatch.setattr(bench_transport, "limits",
                        lambda sizes: {size: {"memcpy_gbps": 9.0, "tcp_socket_gbps": 3.0} for size in sizes})
    return asked


def test_the_extrapolation_the_table_and_the_plot_from_canned_figures(canned, tmp_path):
    report = bench_scale.run(["shm", "verbs"], peers=[8, 64], workers=[1, 4, 12])
    # Linear from the largest N (W): what it cost before any peer, and per peer.
    assert report["extrapolated"]["shm"][10000] == {"threads": 10 + 8 / 64 * 10000, "rss": (100 << 20) + 10000 * 64 * KIB,
                                                   "vm": (1 << 30) + 10000 * (1 << 20), "fds": 20 + 10000}
    assert report["extrapolated"]["tf-grpc"][1000] == {"threads": 40 + 4 * 1000, "rss": (200 + 10 * 1000) << 20}
    check_table_and_plot(bench_scale, report, [
        "verbs: unavailable: no RDMA device",
        "      shm     64      0.64   10 -> 18       1.00         64.0          96.0           128.0      1024.0   0.13     0.50",
        "  machine limits, same run, 64 KiB: memcpy 9.00 GB/s, TCP socket 3.00 GB/s",
        "   12 workers:   88 threads,   320.0 MiB RSS,      8.3 steps/s",
        "extrapolated, shm: 1,000 peers: 135 threads, 162.5 MiB RSS, 1020 fds; "
        "10,000 peers: 1260 threads, 725.0 MiB RSS, 10020 fds",
        "extrapolated, tf-shm: 1,000 peers: 4040 threads, 10200.0 MiB RSS"], tmp_path / "scale.png")


@pytest.mark.parametrize("given, peers, workers", [
    ([], bench_scale.QUICK["peers"], bench_scale.QUICK["workers"]),
    (["--peers", "3,5"], [3, 5], bench_scale.QUICK["workers"]),
    (["--workers", "6"], bench_scale.QUICK["peers"], [6])], ids=["defaults", "peers given", "workers given"])
def test_quick_changes_the_defaults_not_what_was_given(canned, capsys, given, peers, workers):
    assert main(["bench", "scale", "--quick", "--backend", "shm", *given, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert canned["peers"] == list(peers) and [r["peers"] for r in report["transport"]] == list(peers)
    assert canned["workers"] == [list(workers)] * 2  # gRPC's cluster, then shm's
