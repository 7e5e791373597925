"""tf_rdma in TensorBoard from Keras: tf_rdma.keras.StatsCallback's per-peer scalars, and tf_rdma's
collective transfers in the profile Keras' TensorBoard callback captured, read back from what a real
MultiWorkerMirroredStrategy `model.fit` wrote (examples/tf2_mwms_keras.py --tensorboard); the
callback's pieces on their own."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests import with_optional_packages
from tf_rdma.keras import _Rates, peer_label

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def scalars(log_dir):
    """{tag: [(step, value)]} from the event files in `log_dir` itself (TFRecord framing: length,
    its CRC, the Event proto, its CRC), without TensorFlow. Keras' TensorBoard callback writes its
    own in folders below it."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util
    out = {}
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, float(tensor_util.make_ndarray(value.tensor))))
    return out


@pytest.mark.timeout(240)
def test_a_fit_shows_tf_rdma_in_tensorboard_scalars_and_profile(tmp_path):
    pytest.importorskip("tf_keras", reason="the example's model.fit needs Keras 2: "
                                           "pip install --no-deps tf-keras==2.21.0")
    board = tmp_path / "board"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "tf2_mwms_keras.py"), "--launch-local", "--transport", "rdma",
         "--loop", "fit", "--steps", "14", "--warmup-steps", "2", "--hidden", "256", "--json",
         "--tensorboard", str(board)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
        env=with_optional_packages({**os.environ, "PYTHONUNBUFFERED": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"], proc.stderr[-3000:]
    for worker, other in (("worker0", "worker.1"), ("worker1", "worker.0")):
        written = scalars(board / worker)
        # Only the other worker is a peer (no tf_rdma traffic with itself); nothing left on gRPC.
        assert {tag.split("/")[1] for tag in written} == {other}, sorted(written)
        prefix = f"tf_rdma/{other}/"
        # Every 10 steps and at the end of each fit (the warm-up fit's 2 steps, then 12 more).
        assert [step for step, _ in written[prefix + "errors"]] == [2, 10, 14], written
        assert all(value == 0 for _, value in written[prefix + "errors"]), written
        assert prefix + "regrants" in written
        stats = doc["rdma_stats"][worker]
        for direction, total in (("sent", stats["bytes_sent"]), ("received", stats["bytes_received"])):
            rates = written[f"{prefix}{direction}_bytes_per_second"]
            assert [step for step, _ in rates] == [2, 10, 14], rates
            # Every step all-reduces the gradient: each interval moved bytes, never more than
            # the run moved in all (at least a millisecond an interval).
            assert all(0 < rate <= total / 1e-3 for _, rate in rates), (rates, total)

    # The profile of two steps (worker 0, the chief: Keras writes the other's to a directory it
    # deletes): the all-reduce's buffers each way with the other worker, in the trace viewer.
    profiled = subprocess.run([sys.executable, "-m", "tests.tf.programs.trace_events", str(board / "worker0")],
                              capture_output=True, text=True, timeout=120)
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    events = json.loads(profiled.stdout)
    stats = doc["rdma_stats"]["worker0"]
    for name, total in (("tf_rdma collective send", stats["bytes_sent"]),
                        ("tf_rdma collective receive", stats["bytes_received"])):
        found = [e for e in events if e["name"] == name]
        assert found, f"no '{name}' event in the profile: {sorted({e['name'] for e in events})}"
        assert {e["peer"] for e in found} == {"/job:worker/replica:0/task:1"}, found
        assert {e["backend"] for e in found} <= {"tcp", "shm"} and {e["status"] for e in found} == {"OK"}, found
        # Two of the run's 14 steps, each moving the same gradient.
        assert 0 < sum(e["bytes"] for e in found) <= total * 2 / 14 * 1.01, (found, total)


def test_peers_are_named_by_job_and_task():
    assert peer_label("/job:ps/replica:0/task:1") == "ps.1"
    assert peer_label("/job:worker/replica:2/task:0") == "worker.r2.0"
    assert peer_label("tf.data trainer (pid 12)") == "tf.data_trainer_pid_12"


def test_rates_are_bytes_over_the_interval_and_survive_a_reset():
    rates = _Rates()
    record = {"task": "/job:worker/replica:0/task:0", "peers": {}}

    def at(now, sent, received):
        record["peers"] = {"/job:ps/replica:0/task:0": {"bytes_sent": sent, "bytes_received": received}}
        return rates.update([record], now)

    assert at(10.0, 100, 50) == {}  # the first snapshot only starts the interval
    assert at(12.0, 300, 50) == {("/job:worker/replica:0/task:0", "/job:ps/replica:0/task:0"): (100.0, 0.0)}
    # reset_stats() in between: the totals start again from zero.
    assert at(13.0, 40, 10) == {("/job:worker/replica:0/task:0", "/job:ps/replica:0/task:0"): (40.0, 10.0)}


def test_one_callback_class_serves_keras_3_and_tf_keras_whatever_came_first(tmp_path):
    """Imported before either Keras, the class is accepted by a Keras 3 fit and then by a tf_keras
    fit in the same process; with no tf_rdma server it says so once; a bad step count is refused."""
    program = f"""
import logging, numpy as np
import tf_rdma.keras
from tf_rdma.errors import ConfigError
import keras, tf_keras
assert keras.__version__.startswith("3.") and tf_keras.__version__.startswith("2."), (keras.__version__, tf_keras.__version__)
logging.basicConfig()
for k in (keras, tf_keras):
    model = k.Sequential([k.Input((4,)), k.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((8, 4)), np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0,
              callbacks=[tf_rdma.keras.StatsCallback({str(tmp_path)!r}, every_n_steps=1)])
    print("fit with", k.__name__)
try:
    tf_rdma.keras.StatsCallback({str(tmp_path)!r}, every_n_steps=0)
except ConfigError as error:
    print("refused:", error)
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit with keras" in proc.stdout and "fit with tf_keras" in proc.stdout, proc.stdout
    # Once per callback, and each fit had its own.
    assert proc.stderr.count("no tf_rdma server runs in this process") == 2, proc.stderr[-3000:]
    assert "refused: every_n_steps must be a whole number of at least 1, not 0" in proc.stdout
