"""`python -m tf_rdma bench data`: a quick real run (gRPC and shm in one run) whose elements all
arrive, and on canned figures the arithmetic, table and plot, and the failure when elements are
missing or wrong."""
import subprocess
import sys

import pytest

from tests.tf.programs.bench_runs import bench_report, check_png, check_table_and_plot
from tf_rdma.bench import data as bench_data
from tf_rdma.__main__ import main


@pytest.mark.timeout(240)
def test_a_quick_run_reads_every_element_over_grpc_and_tf_rdma(tmp_path):
    plot = tmp_path / "bench.png"
    report, progress = bench_report("data", "--quick", "--backend", "shm", "--sizes", "4K,4M", "--workers", "1",
                          "--plot", str(plot), timeout=200)
    assert report["backends"] == ["shm"] and report["unavailable"] == {} and report["workers"] == 1
    assert [row["size"] for row in report["rows"]] == [4 << 10, 4 << 20]
    for row in report["rows"]:
        per_worker = bench_data.elements_per_worker(row["size"], bench_data.QUICK)
        assert row["elements"] == per_worker
        for transport in ("grpc", "shm"):
            # Exactly the elements the worker made, byte for byte in size, the first byte-exact.
            assert row[f"{transport}_arrived"] == {"elements": per_worker, "bytes": per_worker * row["size"],
                                                   "first_exact": True}, (transport, row)
            assert row[f"{transport}_elements_per_second"] > 0 and row[f"{transport}_cpu_us_per_element"] > 0
        assert row["shm_tf_rdma_bytes_share"] >= 0.99, row
        assert row["vs_grpc_shm"] == pytest.approx(row["shm_elements_per_second"] / row["grpc_elements_per_second"])
        assert row["memcpy_gbps"] > 0 and row["tcp_socket_gbps"] > 0, row
    assert "over grpc" in progress and "over shm" in progress  # the progress lines
    check_png(plot)


def test_bench_data_takes_one_worker_count():
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "bench", "data", "--workers", "1,2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "one --workers count" in result.stderr


PLAN = [[4096, 100], [4 << 20, 10]]
MEASURED = {
    "grpc": [{"size": 4096, "elements": 200, "bytes": 200 * 4096, "first_exact": True, "timed_elements": 100,
              "seconds": 0.5, "cpu_seconds": 0.05, "tf_rdma_bytes": 0},
             {"size": 4 << 20, "elements": 20, "bytes": 20 << 22, "first_exact": True, "timed_elements": 10,
              "seconds": 0.04, "cpu_seconds": 0.02, "tf_rdma_bytes": 0}],
    "shm": [{"size": 4096, "elements": 200, "bytes": 200 * 4096, "first_exact": True, "timed_elements": 100,
             "seconds": 0.25, "cpu_seconds": 0.025, "tf_rdma_bytes": 200 * 4096 + 200 * 100},
            {"size": 4 << 20, "elements": 20, "bytes": 20 << 22, "first_exact": True, "timed_elements": 10,
             "seconds": 0.01, "cpu_seconds": 0.001, "tf_rdma_bytes": 20 << 22}],
}
MACHINE = {4096: {"memcpy_gbps": 5.0, "tcp_socket_gbps": 1.0}, 4 << 20: {"memcpy_gbps": 8.0, "tcp_socket_gbps": 3.0}}


def test_figures_are_per_timed_element_and_ratios_are_elements_per_second_over_grpcs():
    small, large = bench_data.combine(MEASURED, ["shm"], 2, PLAN, MACHINE)
    assert small["elements"] == 200 and large["elements"] == 20
    assert small["grpc_elements_per_second"] == pytest.approx(200.0)
    assert small["shm_elements_per_second"] == pytest.approx(400.0)
    assert small["vs_grpc_shm"] == pytest.approx(2.0)
    assert small["shm_cpu_us_per_element"] == pytest.approx(250.0)
    assert large["vs_grpc_shm"] == pytest.approx(4.0)
    assert large["shm_gbps"] == pytest.approx(10 * (4 << 20) / 0.01 / 1e9)
    assert large["shm_tf_rdma_bytes_share"] == pytest.approx(1.0)
    assert large["memcpy_gbps"] == 8.0 and large["tcp_socket_gbps"] == 3.0


def test_the_table_and_the_plot_from_canned_figures(tmp_path):
    report = {"backends": ["shm"], "unavailable": {"verbs": "no RDMA device"}, "workers": 2, "quick": False,
              "rows": bench_data.combine(MEASURED, ["shm"], 2, PLAN, MACHINE)}
    check_table_and_plot(bench_data, report, ["verbs: unavailable: no RDMA device",
                                              "     4 KiB       200       400     2.00",
                                              "     4 MiB       250      1000     4.00",
                                              "4 MiB memcpy 8.00 socket 3.00 GB/s"], tmp_path / "plot.png")


@pytest.mark.parametrize("wrong", [{"elements": 199, "bytes": 199 * 4096}, {"elements": 201, "bytes": 201 * 4096},
                                   {"bytes": 200 * 4096 - 1}, {"first_exact": False}],
                         ids=["one missing", "one repeated", "a byte short", "first not exact"])
def test_missing_or_wrong_elements_fail_naming_the_size_backend_and_workers(wrong):
    bench_data.check_arrived("shm", MEASURED["shm"], PLAN, 2)  # every element: no error
    rows = [{**MEASURED["shm"][0], **wrong}, MEASURED["shm"][1]]
    with pytest.raises(bench_data.ElementsLost, match=r"bench data over shm, 4 KiB elements from 2 worker\(s\)"):
        bench_data.check_arrived("shm", rows, PLAN, 2)


def test_the_command_exits_1_instead_of_reporting_figures_of_lost_elements(monkeypatch, capsys):
    """The run's own path from the trainers' rows to the exit code, on canned rows (no cluster)."""
    per_worker = bench_data.elements_per_worker(4096, bench_data.QUICK)

    class Served:  # a dispatcher's or a worker's process, none started
        def kill(self):
            pass

        def wait(self):
            return 0

    def read_over(transport, dispatcher_port, plan, params):
        arrived = 2 * per_worker - (transport == "shm")  # shm's trainer missed one
        return [{"size": 4096, "elements": arrived, "bytes": arrived * 4096, "first_exact": True,
                 "timed_elements": arrived - params["warmup"], "seconds": 0.1, "cpu_seconds": 0.01,
                 "tf_rdma_bytes": 0}]
    monkeypatch.setattr(bench_data, "available_backends", lambda: {"shm": None})
    monkeypatch.setattr(bench_data, "limits", lambda sizes, bytes_per_size: MACHINE)
    monkeypatch.setattr(bench_data, "_serve", lambda spec, name, log: Served())
    monkeypatch.setattr(bench_data, "read_over", read_over)
    assert main(["bench", "data", "--quick", "--backend", "shm", "--sizes", "4K", "--workers", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # no table
    assert (f"bench data over shm, 4 KiB elements from 2 worker(s): the trainer received {2 * per_worker - 1} "
            f"elements") in err, err
