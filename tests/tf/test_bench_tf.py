"""`python -m tf_rdma bench tf`: a quick real run of every workload (gRPC and shm in the same run),
and the arithmetic, table and plot on canned figures."""
import statistics
import subprocess
import sys

import pytest

from tests.tf.programs.bench_runs import bench_report, check_png, check_table_and_plot
from tf_rdma.bench import tf as bench_tf


@pytest.mark.timeout(400)
def test_a_quick_run_measures_every_workload_over_grpc_and_tf_rdma(tmp_path):
    plot = tmp_path / "bench.png"
    report, progress = bench_report("tf", "--quick", "--backend", "shm", "--plot", str(plot), timeout=360)
    assert report["backends"] == ["shm"] and report["unavailable"] == {}
    assert set(report["workloads"]) == set(bench_tf.WORKLOADS)
    assert [r["step"] for r in report["workloads"]["step"]] == ["no-op", "counter", "embedding"]
    for workload in ("step", "pss"):
        for row in report["workloads"][workload]:
            # Each round's clusters ran in turn: a ratio is the median of the rounds' ratios.
            assert row["rounds"] == bench_tf.QUICK[workload]["rounds"] == len(row["vs_grpc_shm_rounds"]), row
            for key in [k for k in row if k.startswith("vs_grpc_") and not k.endswith("_rounds")]:
                assert row[key] == pytest.approx(statistics.median(row[key + "_rounds"])), (key, row)
            assert row["grpc_steps_per_second"] > 0 and row["shm_steps_per_second"] > 0, row
    for workload, rows in report["workloads"].items():
        for row in rows if workload not in ("step", "pss") else []:
            if workload in bench_tf.TRAINING:
                expected = row["shm_steps_per_second"] / row["grpc_steps_per_second"]
            else:
                expected = row["grpc_seconds"] / row["shm_seconds"]
            assert row["vs_grpc_shm"] == pytest.approx(expected), (workload, row)
    sizes = [row["size"] for row in report["workloads"]["transfer"]]
    assert sizes == bench_tf.QUICK["transfer_sizes"]
    for row in report["workloads"]["transfer"]:
        assert row["memcpy_gbps"] > 0 and row["tcp_socket_gbps"] > 0, row
    assert [r["model"] for r in report["workloads"]["ps-train"]] == ["embedding", "dense"]
    assert [r["model"] for r in report["workloads"]["pss"]] == ["embedding"]
    for row in report["workloads"]["ps-train"] + report["workloads"]["pss"]:
        assert row["nothing_crosses_steps_per_second"] > 0 and row["nothing_crosses_shm_steps_per_second"] > 0, row
    for row in report["workloads"]["ps-train"]:
        assert row["vs_grpc_nothing_crosses"] == pytest.approx(
            row["nothing_crosses_steps_per_second"] / row["grpc_steps_per_second"])
    assert "over grpc" in progress and "over shm" in progress  # the progress lines
    assert "ps-train with nothing to move" in progress
    assert "pss (TF2 ParameterServerStrategy), and with nothing to move, over grpc, shm" in progress
    check_png(plot)


@pytest.mark.parametrize("model", ["embedding", "dense"])
def test_ps_train_with_nothing_to_move_places_every_op_of_a_worker_on_the_ps(model):
    import tensorflow as tf

    def devices(nothing_crosses):
        graph = tf.Graph()
        with graph.as_default():
            bench_tf._train_step(tf, model, bench_tf.QUICK, 1, nothing_crosses)

        def placed(op):
            """Its own device; else its colocation group's (a variable's initializer), or its
            variable's (a read); else "", which TensorFlow would place on the session's task."""
            if op.device:
                return op.device
            for group in op.colocation_groups():
                name = group.decode()[len("loc:@"):]
                if name != op.name:
                    return placed(graph.get_operation_by_name(name))
            if op.type == "ReadVariableOp":
                return placed(op.inputs[0].op)
            return ""

        return {placed(op) for op in graph.get_operations()}

    assert devices(nothing_crosses=False) == {"/job:ps/task:0", "/job:worker/task:1"}
    assert devices(nothing_crosses=True) == {"/job:ps/task:0"}


def test_an_unknown_workload_is_refused_before_anything_runs():
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "bench", "tf", "--workloads", "many,typo"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown workloads ['typo']" in result.stderr


MEASURED = {
    "grpc": {"transfer": [[{"size": 1 << 20, "seconds": 0.004, "steps": 9}]],
             "many": [[{"tensors": 200, "size": 4096, "seconds": 0.008, "steps": 9}]],
             "hops": [[{"hops": 50, "seconds": 0.010, "steps": 9}]],
             "ps-train": [[{"model": "dense", "seconds": 0.5, "steps": 9}],
                          [{"model": "dense", "seconds": 0.25, "steps": 9}]]},
    "shm": {"transfer": [[{"size": 1 << 20, "seconds": 0.001, "steps": 9}]],
            "many": [[{"tensors": 200, "size": 4096, "seconds": 0.002, "steps": 9}]],
            "hops": [[{"hops": 50, "seconds": 0.004, "steps": 9}]],
            "ps-train": [[{"model": "dense", "seconds": 0.25, "steps": 9}],
                         [{"model": "dense", "seconds": 0.125, "steps": 9}]]},
    "nothing_crosses": {"ps-train": [[{"model": "dense", "seconds": 0.1, "steps": 9}],
                                     [{"model": "dense", "seconds": 0.1, "steps": 9}]]},
    "nothing_crosses_shm": {"ps-train": [[{"model": "dense", "seconds": 0.05, "steps": 9}],
                                         [{"model": "dense", "seconds": 0.05, "steps": 9}]]},
}
MACHINE = {1 << 20: {"memcpy_gbps": 10.0, "tcp_socket_gbps": 3.0}}


def combined(workload):
    return bench_tf.combine(workload, {t: m[workload] for t, m in MEASURED.items() if workload in m}, ["shm"],
                            MACHINE)


def test_ratios_are_grpc_time_over_tf_rdma_time_with_each_workloads_unit():
    [transfer] = combined("transfer")
    assert transfer["vs_grpc_shm"] == pytest.approx(4.0)
    assert transfer["shm_gbps"] == pytest.approx((1 << 20) / 0.001 / 1e9)
    assert transfer["memcpy_gbps"] == 10.0 and transfer["tcp_socket_gbps"] == 3.0
    [many] = combined("many")
    assert many["vs_grpc_shm"] == pytest.approx(4.0)
    assert many["shm_us_per_tensor"] == pytest.approx(10.0)
    [hops] = combined("hops")
    assert hops["grpc_us_per_hop"] == pytest.approx(200.0) and hops["vs_grpc_shm"] == pytest.approx(2.5)
    # Both workers train at once: the cluster's rate is the sum of theirs.
    [train] = combined("ps-train")
    assert train["grpc_steps_per_second"] == pytest.approx(6.0)
    assert train["shm_steps_per_second"] == pytest.approx(12.0)
    assert train["vs_grpc_shm"] == pytest.approx(2.0)
    assert train["nothing_crosses_steps_per_second"] == pytest.approx(20.0)
    assert train["vs_grpc_nothing_crosses"] == pytest.approx(20.0 / 6.0)
    assert train["nothing_crosses_shm_steps_per_second"] == pytest.approx(40.0)
    assert train["vs_grpc_nothing_crosses_shm"] == pytest.approx(40.0 / 6.0)


# Steps per second of each round, the host slowing down in the third.
STEP_RATES = {"grpc": {"no-op": [1000, 1100, 400], "counter": [800, 700, 300], "embedding": [300, 320, 100]},
              "shm": {"no-op": [2500, 2000, 1200], "counter": [1600, 1400, 900], "embedding": [600, 800, 200]}}


class _AbortingSession:
    """A session whose runs raise `error` (or return)."""
    def __init__(self, error=None):
        self.error = error

    def run(self, fetch):
        if self.error is not None:
            raise self.error


def test_a_step_aborted_for_a_repeated_request_id_counts_as_none_and_any_other_abort_fails(capsys):
    import tensorflow as tf
    repeated = tf.errors.AbortedError(None, None, "From /job:ps/replica:0/task:0:\nThe same RunGraph (Worker) "
                                      "request was received twice. graph_handle: \"4\" step_id: 8")
    assert bench_tf.run_step(tf, _AbortingSession(), "step") == 1
    assert bench_tf.run_step(tf, _AbortingSession(repeated), "step") == 0
    assert "a step aborted for a repeated RunGraph request id" in capsys.readouterr().err
    with pytest.raises(tf.errors.AbortedError, match="Session .* is not found"):
        bench_tf.run_step(tf, _AbortingSession(tf.errors.AbortedError(None, None, "Session 8cc5 is not found.")), "step")


def test_a_step_figure_is_the_median_of_its_rounds_each_against_grpc_in_the_same_round():
    rows = {row["step"]: row for row in bench_tf.step_rows(STEP_RATES, ["shm"])}
    assert list(rows) == list(bench_tf.STEPS)
    no_op = rows["no-op"]
    assert no_op["rounds"] == 3
    assert no_op["grpc_steps_per_second"] == 1000 and no_op["shm_steps_per_second"] == 2000
    assert no_op["vs_grpc_shm_rounds"] == pytest.approx([2.5, 2000 / 1100, 3.0])
    assert no_op["vs_grpc_shm"] == pytest.approx(2.5)  # not 2000 / 1000, the medians' ratio
    assert rows["counter"]["vs_grpc_shm"] == pytest.approx(2.0)


# The coordinator's scheduled steps per second of each round: the embedding step, and with nothing to
# move.
PSS_RATES = {"grpc": {"embedding": [50, 60, 20], "nothing_crosses": [200, 150, 90]},
             "shm": {"embedding": [100, 90, 50], "nothing_crosses": [250, 300, 100]}}


def test_a_pss_figure_is_the_median_of_its_rounds_each_against_grpcs_embedding_step_in_the_same_round():
    [pss] = bench_tf.pss_rows(PSS_RATES, ["shm"])
    assert pss["model"] == "embedding" and pss["rounds"] == 3
    assert pss["grpc_steps_per_second"] == 50 and pss["shm_steps_per_second"] == 90
    assert pss["nothing_crosses_steps_per_second"] == 150 and pss["nothing_crosses_shm_steps_per_second"] == 250
    assert pss["vs_grpc_shm_rounds"] == pytest.approx([2.0, 1.5, 2.5]) and pss["vs_grpc_shm"] == pytest.approx(2.0)
    assert pss["vs_grpc_nothing_crosses_rounds"] == pytest.approx([4.0, 2.5, 4.5])
    assert pss["vs_grpc_nothing_crosses"] == pytest.approx(4.0)
    assert pss["vs_grpc_nothing_crosses_shm"] == pytest.approx(5.0)


def test_the_table_and_the_plot_from_canned_figures(tmp_path):
    report = {"backends": ["shm"], "unavailable": {"verbs": "no RDMA device"},
              "workloads": {w: combined(w) for w in bench_tf.WORKLOADS if w not in ("step", "pss")}}
    report["workloads"]["step"] = bench_tf.step_rows(STEP_RATES, ["shm"])
    report["workloads"]["pss"] = bench_tf.pss_rows(PSS_RATES, ["shm"])
    check_table_and_plot(bench_tf, report, ["verbs: unavailable: no RDMA device",
                                            "     200 x 4 KiB      8.00      2.00     4.00",
                                            "         50 hops     200.0      80.0     2.50",
                                            "           dense       6.0      12.0     2.00",
                                            "           no-op      1000      2000     2.50",
                                            "nothing to move over grpc (the workers' ops on the ps): dense 20.0 (3.33x)",
                                            "nothing to move over shm (the workers' ops on the ps): dense 40.0 (6.67x)",
                                            "       embedding      50.0      90.0     2.00",
                                            "nothing to move over grpc (the step function's ops on the ps): "
                                            "embedding 150.0 (4.00x)"],
                         tmp_path / "plot.png")
