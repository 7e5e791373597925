"""tf.data service over tf_rdma's data transfer protocol: a dispatcher, workers and a trainer, each
a process, on the backend under test."""
import json
import os
import signal
import subprocess
import sys
import time

from tests.tf.programs.cluster import PROGRAMS
from tf_rdma import ports

TRAINERS = PROGRAMS / "data_service.py"


class DataService:
    """A dispatcher and workers (one process each), killed when the test ends."""

    def __init__(self, tmp_path, env):
        self.tmp_path = tmp_path
        self.env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="1", **env)
        self.dispatcher_port = ports.free_ports(1)[0]
        self.processes = {}

    def start(self, name, function, env=None, **kwargs):
        log = open(self.tmp_path / f"{name}.log", "w")
        self.processes[name] = subprocess.Popen(
            [sys.executable, str(TRAINERS), function, json.dumps(kwargs)], stdout=log,
            stderr=subprocess.STDOUT, env={**self.env, **(env or {})})

    def log(self, name):
        return (self.tmp_path / f"{name}.log").read_text()

    def wait_serving(self, *names, timeout=60):
        deadline = time.monotonic() + timeout
        for name in names:
            while "serving" not in self.log(name):
                assert self.processes[name].poll() is None, self.log(name)[-3000:]
                assert time.monotonic() < deadline, self.log(name)[-3000:]
                time.sleep(0.2)

    def cluster(self, *worker_protocols):
        self.start("dispatcher", "dispatcher", port=self.dispatcher_port)
        self.wait_serving("dispatcher")
        for i, protocol in enumerate(worker_protocols):
            self.start(f"worker{i}", "worker", dispatcher_port=self.dispatcher_port, protocol=protocol)
        self.wait_serving(*(f"worker{i}" for i in range(len(worker_protocols))))

    def run(self, name, function, timeout, env=None, **kwargs):
        """Runs a trainer to its end; its output file's contents."""
        output = self.tmp_path / f"{name}.json"
        self.start(name, function, env=env, dispatcher_port=self.dispatcher_port, output=str(output), **kwargs)
        try:
            code = self.processes[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout}s:\n{self.log(name)[-3000:]}")
        assert code == 0, self.log(name)[-3000:]
        return json.loads(output.read_text())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()


# Strong enough to load (TF_RDMA_SECRET is checked), and not the one the workers hold.
OTHER_SECRET = "a-strong-secret-the-workers-do-not-hold-8fK2qLw9ZxT4"

def data_peers(stats):
    records = stats.get("servers", [stats])
    return {name: peer for record in records for name, peer in record.get("peers", {}).items()}


def test_trainer_gets_exactly_the_grpc_elements_over_tf_rdma(tmp_path, backend):
    with DataService(tmp_path, {"TF_RDMA_BACKEND": backend}) as service:
        service.cluster("tf_rdma", "tf_rdma")
        result = service.run("trainer", "read", timeout=240)
    for run in ("parallel_epochs/none", "distributed_epoch/none", "distributed_epoch/AUTO"):
        grpc, rdma = result[f"{run}/grpc"], result[f"{run}/tf_rdma"]
        assert rdma["elements"] == grpc["elements"], run
        # parallel_epochs: each of the 2 workers serves every element; distributed_epoch: once.
        assert len(rdma["elements"]) == (80 if run.startswith("parallel_epochs") else 40), run
        assert grpc["tf_rdma_bytes"] == 0, run
        # Uncompressed elements arrive as their tensors' bytes; compressed ones (compression AUTO)
        # as one compressed tensor, smaller than the element.
        if run.endswith("/none"):
            assert rdma["tf_rdma_bytes"] >= 0.99 * rdma["element_bytes"], (run, rdma)
        else:
            assert rdma["tf_rdma_bytes"] > 0, run
    peers = data_peers(result["stats"])
    assert len(peers) == 2 and all(p["backend"] == backend for p in peers.values()), peers
    assert all(p["errors"] == 0 for p in peers.values()), peers
    # Each iteration connects to each worker and ends those connections: none pile up per epoch
    # (a leak would hold 2 more for each of the ITERATIONS_FOR_LEAKS - 1 extra iterations).
    assert result["descriptors_gained/tf_rdma"] <= result["descriptors_gained/grpc"] + 1, result


def test_worker_killed_mid_epoch_the_other_workers_elements_keep_coming(tmp_path, backend):
    # As over gRPC (the test below): the lost worker's reads fail and are retried, the surviving
    # worker's whole epoch arrives, intact.
    read_while_a_worker_dies(tmp_path, "tf_rdma", {"TF_RDMA_BACKEND": backend})


def test_worker_killed_mid_epoch_over_grpc_for_reference(tmp_path):
    read_while_a_worker_dies(tmp_path, "grpc", {})


def read_while_a_worker_dies(tmp_path, protocol, env):
    kill_file, output = tmp_path / "kill-now", tmp_path / "trainer.json"
    with DataService(tmp_path, env) as service:
        service.cluster(protocol, protocol)
        service.start("trainer", "read_until_killed", dispatcher_port=service.dispatcher_port,
                      output=str(output), kill_file=str(kill_file), protocol=protocol)
        deadline = time.monotonic() + 120
        while not kill_file.exists():
            assert service.processes["trainer"].poll() is None, service.log("trainer")[-3000:]
            assert time.monotonic() < deadline, service.log("trainer")[-3000:]
            time.sleep(0.1)
        service.processes["worker1"].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            assert service.processes["trainer"].poll() is None, service.log("trainer")[-3000:]
            elements = json.loads(output.read_text())["elements"] if output.exists() else []
            if sorted({index for index, _ in elements}) == list(range(400)):
                break
            assert time.monotonic() < deadline, f"{len(elements)} elements:\n" + service.log("trainer")[-3000:]
            time.sleep(0.5)
    digests = {}
    for index, digest in elements:
        assert digests.setdefault(index, digest) == digest, index


def test_trainer_reading_a_killed_worker_gets_an_error_naming_it(tmp_path, backend):
    # TensorFlow 2.21's dispatcher keeps a dead worker's task and its client retries Unavailable
    # reads of it without end: over gRPC the trainer waits forever (watched here, same workers,
    # same kill). Over tf_rdma the read fails once the worker cannot be dialed again within
    # TF_RDMA_CONNECT_TIMEOUT_MS, with an error TensorFlow hands to the iterator.
    connect_timeout_s, watch_seconds = 3, 12
    kill_file, killed_file, output = tmp_path / "kill-now", tmp_path / "killed", tmp_path / "trainer.json"
    with DataService(tmp_path, {"TF_RDMA_BACKEND": backend, "TF_RDMA_PEER_TIMEOUT_MS": "2000",
                                "TF_RDMA_CONNECT_TIMEOUT_MS": str(connect_timeout_s * 1000)}) as service:
        service.cluster("tf_rdma", "tf_rdma")
        service.start("trainer", "read_while_worker_lost", dispatcher_port=service.dispatcher_port,
                      output=str(output), kill_file=str(kill_file), killed_file=str(killed_file),
                      watch_seconds=watch_seconds)
        deadline = time.monotonic() + 60
        while not kill_file.exists():
            assert service.processes["trainer"].poll() is None, service.log("trainer")[-3000:]
            assert time.monotonic() < deadline, service.log("trainer")[-3000:]
            time.sleep(0.1)
        worker_pid = service.processes["worker1"].pid
        service.processes["worker1"].send_signal(signal.SIGKILL)
        service.processes["worker1"].wait()
        killed_file.write_text(repr(time.time()))
        assert service.processes["trainer"].wait(watch_seconds + 30) == 0, service.log("trainer")[-3000:]
    result = json.loads(output.read_text())
    runs, killed_at = result["runs"], result["killed_at"]
    print(json.dumps({run: {"elements": r["elements"], "error": r.get("error"),
                            "seconds_after_kill": round(r.get("error_at", result["watched_until"]) - killed_at, 1)}
                      for run, r in runs.items()}))
    for mode in ("parallel_epochs", "distributed_epoch"):
        rdma, grpc = runs[f"{mode}/tf_rdma"], runs[f"{mode}/grpc"]
        assert "error" in rdma and "end" not in rdma, (mode, rdma, service.log("trainer")[-3000:])
        assert rdma["error"].startswith("DeadlineExceededError"), rdma
        assert "lost the tf.data worker" in rdma["error"] and "TF_RDMA_CONNECT_TIMEOUT_MS" in rdma["error"], rdma
        assert f"tf.data worker pid {worker_pid} " in rdma["error"], (worker_pid, rdma)  # the one killed
        # Dialing again takes the connect timeout; TensorFlow's retry backoff comes before it.
        assert connect_timeout_s <= rdma["error_at"] - killed_at < connect_timeout_s + 6, rdma
        # gRPC, the same workers and kill: still waiting, neither an error nor the epoch's end.
        assert "error" not in grpc and "end" not in grpc, (mode, grpc)
        assert result["watched_until"] - killed_at >= watch_seconds


def test_trainer_falls_back_to_grpc_visibly_when_tf_rdma_cannot_reach_the_worker(tmp_path):
    with DataService(tmp_path, {}) as service:
        service.cluster("tf_rdma", "tf_rdma")
        # A trainer whose secret differs fails tf_rdma's handshake with the workers.
        result = service.run("trainer", "read_with_protocol", timeout=120, env={"TF_RDMA_SECRET": OTHER_SECRET})
    assert "error" not in result, result["error"]
    assert result["elements"] == sorted(result["expected"] * 2)
    fallback = result["stats"]["fallback"]
    assert sum(fallback.values()) == 2 and all("over gRPC instead of tf_rdma" in r for r in fallback), fallback
    assert not any(p.get("bytes_received") for p in data_peers(result["stats"]).values())


def test_worker_without_tf_rdma_is_named_in_the_error(tmp_path):
    # TensorFlow 2.21 falls back to gRPC only for its default protocol: a trainer asking for
    # tf_rdma from a worker that does not offer it fails at once, naming the worker.
    with DataService(tmp_path, {}) as service:
        service.cluster("grpc")
        result = service.run("trainer", "read_with_protocol", timeout=120)
    assert "Protocol 'tf_rdma' is not available for worker" in result["error"], result


def test_trainer_cancelled_mid_read_does_not_hang(tmp_path, backend):
    with DataService(tmp_path, {"TF_RDMA_BACKEND": backend}) as service:
        service.cluster("tf_rdma")
        result = service.run("trainer", "cancel_mid_read", timeout=180)
    assert result["after"] == result["expected"]
