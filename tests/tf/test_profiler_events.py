"""tf_rdma's transfers as events of TensorFlow's profiler (what TensorBoard's trace viewer shows):
captured during TF1 ps steps, each with its peer task, backend, bytes and step id."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_ps_steps_show_each_transfer_with_its_peer_bytes_and_step(tmp_path, backend):
    output = tmp_path / "events.json"
    proc = subprocess.run([sys.executable, "-m", "tests.tf.programs.profiled_ps_steps", str(tmp_path / "log"),
                           str(output)], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "TF_RDMA_BACKEND": backend})
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(output.read_text())
    events, steps, size = run["events"], run["steps"], run["bytes"]
    ps, worker = "/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0"

    def of(name, peer):
        return [e for e in events if e["name"] == name and e["peer"] == peer]

    # Both servers are in the profiled process: each end of each transfer is there.
    weights_to_worker = of("tf_rdma receive", ps)          # the worker receiving the ps's weights
    weights_from_ps = of("tf_rdma send", worker)           # the ps sending them
    gradients_to_ps = of("tf_rdma receive", worker)        # the ps receiving the worker's gradient
    gradients_from_worker = of("tf_rdma send", ps)         # the worker sending it
    for found in (weights_to_worker, weights_from_ps, gradients_to_ps, gradients_from_worker):
        assert len(found) >= steps, events
        assert {e["backend"] for e in found} == {backend}, found
        assert {e["status"] for e in found} == {"OK"}, found
        assert all(e["duration_us"] > 0 for e in found), found
    # A receive counts the tensor's bytes; a send what it wrote, the tensor and its header.
    assert {e["bytes"] for e in weights_to_worker + gradients_to_ps} == {size}, events
    assert all(size < e["bytes"] < size + 256 for e in weights_from_ps + gradients_from_worker), events
    # Each event names its step: every profiled step moved the weights and the gradient, and the
    # two ends of a transfer name the same step.
    step_ids = {e["step_id"] for e in weights_to_worker}
    assert len(step_ids) == steps, weights_to_worker
    assert step_ids == {e["step_id"] for e in weights_from_ps} == {e["step_id"] for e in gradients_to_ps}
