"""The bench's own arithmetic, on canned outputs: perftest's result rows parsed by column, units
converted, tf_rdma's ratios (vs_X == tf_rdma's figure / X's), and the rounds summarized as medians
of the per-round ratios with their spread. The performance tables in the README come from these.
Also the benches' bounded wait for a child's line, and a short real run pinned to one CPU."""
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.tf.programs.bench_runs import bench_report
from tf_rdma.bench import transport as bench
from tf_rdma.bench._common import line_within
from tf_rdma.__main__ import main
from tf_rdma.sizes import format_size, parse_size, parse_sizes

IB_WRITE_BW = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF          Device         : rxe0
 Number of qps   : 1            Transport type : IB
 Connection type : RC           Using SRQ      : OFF
 TX depth        : 4
 CQ Moderation   : 1
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      64               98.33              95.37                0.001526
 1048576    16               120.50             110.25               0.000110
---------------------------------------------------------------------------------------
"""

IB_WRITE_LAT = """\
 Mtu             : 1024[B]
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]
 8       50          20.12          150.33       25.50              30.25           10.10           150.33                 150.33
---------------------------------------------------------------------------------------
"""


def test_sizes_are_read_in_binary_units_and_printed_in_the_largest_whole_one():
    assert parse_sizes("8, 4K,1M,16MiB") == [8, 4 << 10, 1 << 20, 16 << 20]
    assert parse_size("1 GB") == parse_size("1g") == 1 << 30
    with pytest.raises(ValueError, match="not a size: '4X'"):
        parse_size("4X")
    assert [format_size(n) for n in (8, 4096, 1536, 64 << 20, 2 << 30)] == [
        "8 B", "4 KiB", "1536 B", "64 MiB", "2 GiB"]


def test_perftest_result_row_is_read_by_column_name():
    assert bench.parse_perftest(IB_WRITE_BW, 1048576) == {
        "#bytes": 1048576, "#iterations": 16, "BW peak[MB/sec]": 120.50,
        "BW average[MB/sec]": 110.25, "MsgRate[Mpps]": 0.000110}
    latency = bench.parse_perftest(IB_WRITE_LAT, 8)
    assert (latency["t_avg[usec]"], latency["t_typical[usec]"], latency["99% percentile[usec]"]) == \
        (30.25, 25.50, 150.33)


def test_a_size_perftest_did_not_report_is_an_error():
    with pytest.raises(bench.PerftestError, match="no result row for 4096 bytes"):
        bench.parse_perftest(IB_WRITE_BW, 4096)


def test_perftest_bandwidth_becomes_gigabytes_per_second():
    # perftest's MB/sec are MiB/s; tf_rdma's GB/s are 1e9 bytes/s. --report_gbits gives Gb/s.
    assert bench.bandwidth_gbps({"BW average[MB/sec]": 1000.0}) == pytest.approx(1000 * 1048576 / 1e9)
    assert bench.bandwidth_gbps({"BW average[Gb/sec]": 80.0}) == pytest.approx(10.0)
    with pytest.raises(bench.PerftestError, match="unknown bandwidth unit"):
        bench.bandwidth_gbps({"BW average[furlongs]": 1.0})


def test_settings_are_read_from_perftests_header_or_missing():
    assert bench._setting(IB_WRITE_BW, "TX depth") == 4
    assert bench._setting(IB_WRITE_BW, "Mtu") == 1024
    assert bench._setting(IB_WRITE_LAT, "TX depth") is None


def test_baseline_ratios_are_tf_rdmas_figure_over_the_baselines():
    report = bench.add_baseline_ratios({
        "throughput": [{"size": 4 << 20, "transport_gbps": 6.0, "tcp_socket_gbps": 2.0, "memcpy_gbps": 12.0}],
        "latency": [{"size": 8, "transport_us": 30.0, "tcp_socket_us": 20.0}]})
    assert report["throughput"][0]["vs_tcp_socket"] == 3.0
    assert report["throughput"][0]["vs_memcpy"] == 0.5
    assert report["latency"][0]["vs_tcp_socket"] == 1.5


def test_perftest_ratios_are_tf_rdmas_figure_over_perftests():
    report = {"throughput": [{"size": 65536, "transport_gbps": 0.2}, {"size": 1048576, "transport_gbps": 0.3}],
              "latency": [{"size": 8, "transport_us": 90.75}]}
    perftest = {"ib_write_bw": {65536: {"gbps": bench.bandwidth_gbps(bench.parse_perftest(IB_WRITE_BW, 65536))}},
                "ib_write_lat": {8: {"avg_us": 30.25, "typical_us": 25.5}}}
    bench.add_perftest(report, perftest)
    row = report["throughput"][0]
    assert row["ib_write_bw_gbps"] == pytest.approx(95.37 * 1048576 / 1e9)
    assert row["vs_ib_write_bw"] == pytest.approx(0.2 / (95.37 * 1048576 / 1e9))
    # A size perftest could not measure has no ratio, rather than a made-up one.
    assert report["throughput"][1]["ib_write_bw_gbps"] is None and report["throughput"][1]["vs_ib_write_bw"] is None
    latency = report["latency"][0]
    assert (latency["ib_write_lat_us"], latency["ib_write_lat_typical_us"]) == (30.25, 25.5)
    assert latency["vs_ib_write_lat"] == pytest.approx(3.0)
    assert set(perftest["ib_write_bw"]) == {"65536"}, "JSON keys are strings"


def test_rounds_summarize_as_the_median_of_each_rounds_own_ratio_with_its_spread():
    figures = ("transport_gbps", "ib_write_bw_gbps", "vs_ib_write_bw")
    rounds = [(1.0, 1.0), (4.0, 1.0), (2.0, 4.0)]  # (tf_rdma, perftest) per round
    rows = [{"size": 1 << 20, "transport_gbps": ours, "ib_write_bw_gbps": theirs, "vs_ib_write_bw": ours / theirs}
            for ours, theirs in rounds]
    [row] = bench.summarize_rows(rows, figures)
    assert row["size"] == 1 << 20
    assert (row["transport_gbps"], row["ib_write_bw_gbps"]) == (2.0, 1.0)
    # The median of the per-round ratios (1, 4, 0.5), not the ratio of the medians (2 / 1).
    assert row["vs_ib_write_bw"] == 1.0
    assert (row["vs_ib_write_bw_min"], row["vs_ib_write_bw_max"]) == (0.5, 4.0)
    assert [r["vs_ib_write_bw"] for r in row["rounds"]] == [1.0, 4.0, 0.5]


def test_rounds_where_perftest_failed_are_left_out_of_the_median():
    figures = ("transport_gbps", "ib_write_bw_gbps", "vs_ib_write_bw")
    rows = [{"size": 8, "transport_gbps": 1.0, "ib_write_bw_gbps": None, "vs_ib_write_bw": None},
            {"size": 8, "transport_gbps": 3.0, "ib_write_bw_gbps": 2.0, "vs_ib_write_bw": 1.5}]
    [row] = bench.summarize_rows(rows, figures)
    assert (row["transport_gbps"], row["ib_write_bw_gbps"], row["vs_ib_write_bw"]) == (2.0, 2.0, 1.5)
    assert (row["vs_ib_write_bw_min"], row["vs_ib_write_bw_max"]) == (1.5, 1.5)


def test_perftest_runs_merge_into_medians_keeping_each_round():
    runs = [{"available": True, "device": "dev0", "mtu": None, "errors": [],
             "ib_write_bw": {65536: {"gbps": 1.0, "tx_depth": 4}}, "ib_write_lat": {8: {"avg_us": 10.0, "typical_us": 9.0}}},
            {"available": True, "device": "dev0", "mtu": 1024, "errors": ["ib_write_lat -s 8: boom"],
             "ib_write_bw": {65536: {"gbps": 3.0, "tx_depth": 4}}, "ib_write_lat": {}},
            {"available": True, "device": "dev0", "mtu": 1024, "errors": [],
             "ib_write_bw": {65536: {"gbps": 2.5, "tx_depth": 4}}, "ib_write_lat": {8: {"avg_us": 20.0, "typical_us": 11.0}}}]
    summary = bench.summarize_perftest(runs)
    assert summary["mtu"] == 1024 and summary["errors"] == ["ib_write_lat -s 8: boom"]
    assert summary["ib_write_bw"]["65536"]["gbps"] == 2.5
    assert summary["ib_write_bw"]["65536"]["rounds_gbps"] == [1.0, 3.0, 2.5]
    assert summary["ib_write_lat"]["8"]["avg_us"] == 15.0
    assert summary["ib_write_lat"]["8"]["rounds_typical_us"] == [9.0, 11.0]


def child(code):
    """`python -c CODE` with its stdout on a pipe and its stderr in a file, as the benches start theirs."""
    log = tempfile.TemporaryFile("w+")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True), log


def test_a_childs_line_is_read_past_the_lines_before_it():
    process, log = child("print('starting'); print('READY 1 2', flush=True); import time; time.sleep(60)")
    try:
        assert line_within(process, "READY ", 30, "the peer", log) == "1 2\n"
    finally:
        process.kill()
        process.wait()


def test_a_child_that_falls_silent_is_killed_at_the_deadline_and_named_with_its_log():
    process, log = child("import sys, time; print('about to hang', file=sys.stderr, flush=True); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)the peer: it wrote no line starting 'READY' within 1 s, so it "
                                           r"was killed; its log ends:\nabout to hang"):
        line_within(process, "READY ", 1, "the peer", log)
    assert time.monotonic() - started < 10 and process.poll() is not None


def test_a_child_that_exits_without_the_line_is_named_with_its_exit_code_and_log():
    process, log = child("import sys; print('no device', file=sys.stderr); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"(?s)the peer: it exited with code 3 before writing a line starting "
                                           r"'READY'; its log ends:\nno device"):
        line_within(process, "READY ", 30, "the peer", log)


def test_a_wait_ends_at_once_naming_the_peer_it_needs_when_that_peer_exits():
    process, log = child("import time; time.sleep(60)")  # waits on the ps for ever
    ps, ps_log = child("import sys; sys.exit(3)")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the workers: the ps exited with code 3 while it waited"):
        line_within(process, "READY ", 60, "the workers", log, needed=(ps, "the ps"))
    assert time.monotonic() - started < 10 and process.poll() is not None
    ps_log.close()


def test_a_pinned_run_keeps_the_bench_and_its_receiver_on_that_cpu_and_says_so():
    cpu = max(os.sched_getaffinity(0))  # the last, so that on more than one CPU the pin narrows
    report, _ = bench_report("transport", "--backend", "shm", "--sizes", "64K", "--bytes-per-size", "1M",
                             "--latency-sizes", "8", "--round-trips", "50", "--pin", str(cpu), timeout=300)
    shm = report["shm"]
    assert shm["pinned_cpu"] == cpu
    assert shm["receiver_cpus"] == [cpu], "the receiver's threads may run elsewhere"
    [row] = shm["latency"]
    assert row["size"] == 8 and row["transport_us"] > 0 and row["tcp_socket_us"] > 0
    assert f"one-way latency (us), cores free to sleep, pinned to CPU {cpu} (bench and receiver)" in \
        bench.render(report)


def test_the_pin_holds_for_its_run_only():
    before = os.sched_getaffinity(0)
    cpu = max(before)
    with bench.pinned_to(cpu):
        assert os.sched_getaffinity(0) == {cpu}
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("value", [str(max(os.sched_getaffinity(0)) + 1), "first"])
def test_a_cpu_this_process_may_not_run_on_is_refused_naming_the_option_and_the_allowed_cpus(value, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "transport", "--pin", value])
    allowed = ", ".join(map(str, sorted(os.sched_getaffinity(0))))
    assert exit.value.code == 2
    assert (f"error: argument --pin: {value!r} is not a CPU this process may run on; it may run on {allowed}"
            in capsys.readouterr().err)


def test_pin_is_refused_by_the_benches_it_does_not_apply_to(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "tf", "--pin", str(min(os.sched_getaffinity(0)))])
    assert "--pin is for bench transport, not tf" in capsys.readouterr().err
