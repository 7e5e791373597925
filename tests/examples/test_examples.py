"""The examples, run for real as multi-process clusters with tiny step counts.

Each test starts real TensorFlow processes on loopback, checks that training works (loss goes down,
accuracy well above chance) and that every process is gone afterwards. Every transport in
TRANSPORTS runs every test.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import with_optional_packages

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import cluster_utils as cu  # noqa: E402

# Every test runs over each transport (one only, for a quicker run:
# EXAMPLES_TRANSPORTS=grpc pytest tests/examples; not a TF_RDMA_ name: tf_rdma rejects
# TF_RDMA_ variables it does not know).
TRANSPORTS = os.environ.get("EXAMPLES_TRANSPORTS", "grpc,rdma").split(",")

pytestmark = [pytest.mark.examples, pytest.mark.parametrize("transport", TRANSPORTS)]

ENV = with_optional_packages(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1"))  # digits


def run_example(script, *args, timeout, env=None):
    """Runs an example to its end; `env` adds variables (e.g. TF_RDMA_BACKEND)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env={**ENV, **(env or {})})
    return proc


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_gone(pids):
    assert pids, "no task pids were reported"
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {n: p for n, p in pids.items() if alive(p)}
    assert not left, f"tasks outlived their launcher: {left}"


def assert_learned(result, min_accuracy=0.8):
    assert result["loss_last_window"] < 0.5 * result["loss_first_window"], result
    if "final_test_accuracy" in result:
        assert result["final_test_accuracy"] >= min_accuracy, result


def assert_rdma_carried(stats):
    """With --transport rdma, the tensors must really have crossed over tf_rdma."""
    assert stats and stats["bytes_sent"] > 0 and stats["bytes_received"] > 0, stats
    assert stats["errors"] == 0, stats


@pytest.mark.timeout(260)
def test_demo_cluster_trains_and_reports_throughput(transport):
    proc = run_example("demo_cluster.py", "--transports", transport, "--steps", 30,
                       "--eval-every", 10, "--mwms-steps", 8, "--json", timeout=250)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    run = doc["runs"][transport]
    assert doc["ok"] and "error" not in run
    assert run["examples_per_sec"] > 0 and run["steps_per_sec"] > 0
    assert run["global_step"] == 2 * 30
    assert run["mib_per_step_each_way"] > 16        # the default MLP: several MB per step
    assert [e["step"] for e in run["evals"]] == [10, 20, 30]
    # Asynchronous training: a worker whose first steps come after the other's trained the shared
    # weights starts from a low loss (the demo's 30 steps take a second), so learning is judged
    # over the run: the worst last window against the first window that saw the untrained model.
    first = max(worker["loss_first_window"] for worker in run["workers"])
    assert max(worker["loss_last_window"] for worker in run["workers"]) < 0.5 * first, run["workers"]
    for worker in run["workers"]:
        if transport == "rdma":
            assert_rdma_carried(worker["rdma_stats"])
    assert run["final_test_accuracy"] >= 0.8
    assert "examples/s" in proc.stderr              # the side-by-side table
    assert_all_gone(run["pids"])
    mwms = doc["mwms_runs"][transport]
    assert "error" not in mwms and mwms["examples_per_sec"] > 0, mwms
    assert mwms["final_test_accuracy"] >= 0.5, mwms
    if transport == "rdma":
        for stats in mwms["rdma_stats"].values():
            assert_rdma_carried(stats)
    assert "MultiWorkerMirroredStrategy" in proc.stderr


@pytest.mark.timeout(120)
def test_demo_fails_fast_and_cleans_up_when_a_task_dies(transport, tmp_path):
    # The demo SIGKILLs the ps once worker 0 reached step 10: the run must fail with a message
    # naming the dead task, well before the steps could finish, and leave no process behind.
    t0 = time.monotonic()
    proc = run_example("demo_cluster.py", "--transports", transport, "--steps", 5000,
                       "--hidden", "256,256", "--inject-failure", "ps0@10", "--mwms-steps", 0, "--json",
                       "--log-dir", tmp_path, timeout=110)
    assert proc.returncode == 1, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["runs"][transport]
    assert "ps0 (pid" in run["error"] and "was killed by SIGKILL" in run["error"], run["error"]
    assert "FAILED" in proc.stderr
    assert (tmp_path / transport / "ps0.log").exists()     # logs are kept for a failed run
    assert time.monotonic() - t0 < 100
    assert_all_gone(run["pids"])


@pytest.mark.timeout(150)
def test_tf1_script_per_task_from_tf_config(transport):
    # One process per task configured only through TF_CONFIG, as a cluster manager would start
    # them; the ps must exit by itself once both workers are done.
    cluster = cu.local_cluster(1, 2, transport=transport)
    tasks = [("ps", 0), ("worker", 0), ("worker", 1)]
    procs = {}
    try:
        for job, index in tasks:
            tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
            procs[f"{job}{index}"] = subprocess.Popen(
                [sys.executable, str(EXAMPLES / "tf1_ps_training.py"), "--transport", transport,
                 "--steps", "20", "--eval-every", "10", "--events", "--timeout", "120"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=dict(ENV, TF_CONFIG=tf_config))
        outputs = {name: p.communicate(timeout=130)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{outputs[name][-3000:]}"
    assert "all workers done, exiting" in outputs["ps0"]
    results = {}
    for name in ("worker0", "worker1"):
        events = [cu.parse_event(line) for line in outputs[name].splitlines()]
        results[name] = [e for e in events if e and e.get("kind") == "result"][0]
        assert_learned(results[name])
        if transport == "rdma":
            assert_rdma_carried(results[name]["rdma_stats"])
    assert results["worker0"]["global_step"] == 40
    assert "final test accuracy" in outputs["worker0"]


@pytest.mark.timeout(150)
def test_tf2_parameter_server_strategy_launch_local(transport):
    pytest.importorskip("tf_keras", reason="the example's model.fit needs Keras 2: "
                                           "pip install --no-deps tf-keras==2.21.0")
    proc = run_example("tf2_ps_keras.py", "--launch-local", "--transport", transport,
                       "--steps", 40, "--eval-every", 20, "--json", timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"], proc.stderr[-3000:]
    result = doc["result"]
    assert_learned(result, min_accuracy=0.7)
    assert result["steps"] == 40
    # Keras 2 model.fit ran it: one fit epoch of 4 warm-up steps, then one per evaluation.
    assert result["keras"].startswith("2."), result
    assert result["epoch_steps"] == [4, 16, 20], result
    # Each step's increment is an atomic add on the ps, whichever worker ran it.
    assert result["optimizer_iterations"] == 40, result
    assert result["examples_per_sec"] > 0
    if transport == "rdma":
        for name in ("ps0", "worker0", "worker1"):
            assert_rdma_carried(doc["rdma_stats"][name])
    assert_all_gone(doc["pids"])


@pytest.mark.timeout(150)
def test_tf2_multi_worker_mirrored_custom_loop_launch_local(transport):
    proc = run_example("tf2_mwms_keras.py", "--launch-local", "--transport", transport, "--loop", "custom",
                       "--steps", 12, "--json", timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"], proc.stderr[-3000:]
    result = doc["result"]
    assert result["last_loss"] < 0.5 * result["first_loss"] and result["final_test_accuracy"] >= 0.5, result
    assert result["optimizer_iterations"] == 12, result
    if transport == "rdma":
        for stats in doc["rdma_stats"].values():
            assert_rdma_carried(stats)
    assert_all_gone(doc["pids"])
