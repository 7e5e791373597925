"""TF2 ParameterServerStrategy: training through tf_rdma's strategy, with the ps<->worker variable
and gradient traffic carried by tf_rdma (read from the worker's and the ps's stats), each transfer
granted ahead of its bytes: planned from static shapes where the receiver partitions the function
(the worker), else sized at its first crossing (the ps)."""
import json
import time

import pytest

from tests.tf.programs.cluster import Cluster


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(400)
def test_ps_strategy_training_goes_over_tf_rdma(tmp_path):
    output = str(tmp_path / "losses.json")
    worker_stats = str(tmp_path / "worker-stats.json")
    ps_stats = str(tmp_path / "ps-stats.json")
    with Cluster(tmp_path, {"chief": 1, "ps": 1, "worker": 1}, env={"TF_RDMA_BACKEND": "auto"}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma", stats_file=ps_stats)
        cluster.start("worker", 0, "serve", transport="rdma", stats_file=worker_stats)
        cluster.start("chief", 0, "ps_strategy_coordinator", transport="rdma", output=output)
        assert cluster.wait("chief", 0, timeout=300) == 0, cluster.log("chief", 0)[-4000:] + cluster.log("worker", 0)[-3000:]
        finished = time.time()
        stats = cluster.stats_dumped_after(worker_stats, finished)
        on_ps = cluster.stats_dumped_after(ps_stats, finished)
    with open(output) as f:
        result = json.load(f)
    losses = result["losses"]
    assert losses[-1] < losses[0] * 0.8, losses
    # Every task, the coordinator included, proved itself to the coordinator's probe half way; no
    # task took the probe for a peer (its stats name the cluster's tasks only), nor let it take a
    # connection's place (the one-connection check below).
    tasks = {"/job:chief/replica:0/task:0", "/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0"}
    assert result["answers"] == dict.fromkeys(tasks, True), result["answers"]
    assert set(stats["peers"]) | set(on_ps["peers"]) <= tasks, (stats["peers"].keys(), on_ps["peers"].keys())
    assert stats["fallback"] == {}, stats
    ps = stats["peers"]["/job:ps/replica:0/task:0"]
    worker = on_ps["peers"]["/job:worker/replica:0/task:0"]
    # Variables come from the ps, gradient updates go to it: 64x256 floats and more every step.
    assert ps["bytes_received"] >= 30 * 64 * 256 * 4, ps
    assert ps["bytes_sent"] >= 30 * 64 * 256 * 4, ps

    # The small variables (w2, b1, b2) come in one message per step, and their gradients go in one:
    # the worker partitions each step function, so it plans the messages of both sides.
    assert ps["fused_messages_received"] >= 30 and ps["fused_messages_sent"] >= 30, ps
    assert worker["fused_messages_sent"] >= 30 and worker["fused_messages_received"] >= 30, worker

    # The worker instantiates each step function: its receives are planned, none regrants.
    assert stats["receives_planned"] > 0, stats
    assert ps["regrants"] == 0, ps
    # The ps runs its part as shipped, unplanned: a transfer regrants at its first crossing only.
    assert worker["bytes_received"] >= 30 * 64 * 256 * 4, worker
    assert worker["regrants"] * 10 <= worker["tensors_received"], worker

    # auto: the task with the smaller name (the ps) connects, picks shm for a peer on this host
    # and says why; the pair's one connection carried the whole run.
    assert (worker["backend"], worker["backend_reason"]) == ("shm", "peer is on this host"), worker
    assert (ps["backend"], ps["backend_reason"]) == ("shm", "chosen by the peer, which connects"), ps
    assert worker["connects"] == ps["connects"] == 1, (worker, ps)
