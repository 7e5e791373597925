"""TF2 Keras 2 (tf_keras) `model.fit` under tf_rdma's ParameterServerStrategy: training works
(loss decreases over the epochs) and the ps<->worker variable and gradient traffic went over
tf_rdma (read from the worker's stats)."""
import json
import subprocess
import sys
import time

import pytest

from tests.tf.programs.cluster import PROGRAMS, Cluster

pytest.importorskip("tf_keras", reason="model.fit under ParameterServerStrategy needs Keras 2: "
                                       "pip install --no-deps tf-keras==2.21.0")

COORDINATOR = PROGRAMS / "keras_fit_coordinator.py"


class KerasFitCluster(Cluster):
    def start_coordinator(self, **kwargs):
        """The chief, running keras_fit_coordinator.py instead of a function of tasks.py."""
        log = open(self.tmp_path / "chief0.log", "w")
        process = subprocess.Popen(
            [sys.executable, str(COORDINATOR), json.dumps({"cluster": self.spec, **kwargs})],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.processes[("chief", 0)] = process
        return process


@pytest.mark.timeout(180)
def test_keras_fit_under_ps_strategy_goes_over_tf_rdma(tmp_path):
    output = str(tmp_path / "history.json")
    worker_stats = str(tmp_path / "worker-stats.json")
    epochs, steps_per_epoch = 3, 20
    with KerasFitCluster(tmp_path, {"chief": 1, "ps": 1, "worker": 1}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        cluster.start("worker", 0, "serve", transport="rdma", stats_file=worker_stats)
        cluster.start_coordinator(output=output, transport="rdma", epochs=epochs,
                                  steps_per_epoch=steps_per_epoch)
        assert cluster.wait("chief", 0, timeout=150) == 0, \
            cluster.log("chief", 0)[-4000:] + cluster.log("worker", 0)[-3000:]
        stats = cluster.stats_dumped_after(worker_stats, time.time())
    with open(output) as f:
        result = json.load(f)
    losses = result["loss"]
    assert len(losses) == epochs, result
    assert all(b < a for a, b in zip(losses, losses[1:])), result
    assert losses[-1] < losses[0] * 0.8, result
    assert result["iterations"] == epochs * steps_per_epoch, result
    assert all("/job:ps/" in d for d in result["devices"]), result
    assert stats["fallback"] == {}, stats
    ps = stats["peers"]["/job:ps/replica:0/task:0"]
    assert ps["backend"] in ("tcp", "shm", "verbs"), ps
    # Every step the worker reads the 64x256 kernel (and the rest) from the ps and sends the
    # gradients back for SGD to apply there.
    traffic = epochs * steps_per_epoch * 64 * 256 * 4
    assert ps["bytes_received"] >= traffic, ps
    assert ps["bytes_sent"] >= traffic, ps
    assert ps.get("errors", 0) == 0, ps
