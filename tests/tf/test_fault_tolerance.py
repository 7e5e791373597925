"""TF2 ParameterServerStrategy's fault tolerance, kept by tf_rdma: ClusterCoordinator tells a ps
failure (raised to the user) from a worker failure (retried) by the error the transport reports,
and a restarted task must be usable again. Each scenario runs over stock gRPC and over tf_rdma, and
must end the same way, in about the same time."""
import json
import signal
import subprocess
import time

import pytest

from tests.tf.programs.cluster import PROGRAMS, Cluster

PROGRAM = PROGRAMS / "fault.py"
PS = "/job:ps/replica:0/task:0"


def outcome_of(cluster, output, timeout):
    assert cluster.wait("chief", 0, timeout=timeout) == 0, cluster.log("chief", 0)[-3000:]
    with open(output) as f:
        return json.load(f)


def ps_killed(tmp_path, transport, during):
    output = str(tmp_path / f"outcome-{transport}.json")
    with Cluster(tmp_path, {"chief": 1, "ps": 1, "worker": 1}) as cluster:
        cluster.start("ps", 0, "serve", transport=transport)
        cluster.start("worker", 0, "serve", transport=transport)
        cluster.start("chief", 0, "until_ps_failure", program=PROGRAM, transport=transport,
                      output=output, during=during)
        cluster.wait_for_output("chief", 0, "warm" if during == "schedule" else "joining", timeout=180)
        time.sleep(1.0)
        killed_at = time.time()
        cluster.signal("ps", 0, signal.SIGKILL)
        outcome = outcome_of(cluster, output, timeout=150)
    assert outcome, f"{transport}: the coordinator never failed"
    return outcome, outcome["failed_at"] - killed_at


@pytest.mark.timeout(600)
@pytest.mark.parametrize("during", ["schedule", "join"])
def test_a_killed_ps_fails_the_coordinator_as_with_grpc(tmp_path, during):
    stock, stock_seconds = ps_killed(tmp_path, "grpc", during)
    ours, seconds = ps_killed(tmp_path, "rdma", during)
    assert ours["error"] == stock["error"] == "UnavailableError", (stock, ours)
    assert ours["where"] == stock["where"] == during, (stock, ours)
    assert PS in ours["message"], ours
    assert seconds < stock_seconds + 5, (stock_seconds, seconds, ours)


def restarts(tmp_path, transport):
    """A worker killed mid-training and started again; then the ps killed, started again, and a new
    coordinator training on the cluster (the ps lost its variables: TensorFlow's recovery is a new
    coordinator, from a checkpoint in real use)."""
    output = str(tmp_path / f"restart-{transport}.json")
    with Cluster(tmp_path, {"chief": 1, "ps": 1, "worker": 1}) as cluster:
        cluster.start("ps", 0, "serve", transport=transport)
        cluster.start("worker", 0, "serve", transport=transport)
        cluster.start("chief", 0, "through_worker_restart", program=PROGRAM, transport=transport,
                      output=output)
        cluster.wait_for_output("chief", 0, "warm", timeout=180)
        time.sleep(1.0)
        cluster.signal("worker", 0, signal.SIGKILL)
        cluster.wait("worker", 0, timeout=30)
        time.sleep(2.0)  # downtime: the coordinator sees the worker gone
        cluster.start("worker", 0, "serve", transport=transport)
        after_worker_restart = outcome_of(cluster, output, timeout=240)

        cluster.signal("ps", 0, signal.SIGKILL)
        cluster.wait("ps", 0, timeout=30)
        cluster.start("ps", 0, "serve", transport=transport)
        cluster.start("chief", 0, "trains_again", program=PROGRAM, transport=transport, output=output)
        after_ps_restart = outcome_of(cluster, output, timeout=180)
    return after_worker_restart, after_ps_restart


@pytest.mark.timeout(900)
def test_restarted_worker_and_ps_are_used_again_as_with_grpc(tmp_path):
    stock = restarts(tmp_path, "grpc")
    ours = restarts(tmp_path, "rdma")
    for worker_restart, ps_restart in (stock, ours):
        # Steps lost with the worker are retried, so every one ran (a step the worker finished but
        # could not report runs twice: TensorFlow's at-least-once).
        assert "error" not in worker_restart and worker_restart["iterations"] >= 310, (stock, ours)
        assert ps_restart == {"iterations": 20}, (stock, ours)
    assert ours[0]["seconds"] < stock[0]["seconds"] + 10, (stock, ours)


def copies_around_a_frozen_worker(tmp_path, transport, peer_timeout_s=2.0, frozen_s=None, connect_timeout_s=60.0):
    """Worker 0 frozen for `frozen_s` (twice the peer timeout unless given) while the coordinator
    copies a tensor to it; the copy program's outcome."""
    output = str(tmp_path / f"frozen-{transport}.json")
    env = {"TF_RDMA_PEER_TIMEOUT_MS": str(int(peer_timeout_s * 1000)),
           "TF_RDMA_CONNECT_TIMEOUT_MS": str(int(connect_timeout_s * 1000))}
    with Cluster(tmp_path, {"chief": 1, "ps": 1, "worker": 2}, env=env) as cluster:
        cluster.start("ps", 0, "serve", transport=transport)
        for i in range(2):
            cluster.start("worker", i, "serve", transport=transport)
        chief = cluster.start("chief", 0, "copies_past_a_frozen_worker", program=PROGRAM, transport=transport,
                              output=output, stdin=subprocess.PIPE)
        cluster.wait_for_output("chief", 0, "warm", timeout=180)
        cluster.signal("worker", 0, signal.SIGSTOP)
        chief.stdin.write(b"frozen\n")
        chief.stdin.flush()
        cluster.wait_for_output("chief", 0, "copying", timeout=30)
        time.sleep(frozen_s or 2 * peer_timeout_s)  # the coordinator's connection to worker 0 ends meanwhile
        cluster.signal("worker", 0, signal.SIGCONT)
        chief.stdin.write(b"resumed\n")
        chief.stdin.flush()
        return outcome_of(cluster, output, timeout=150)


def assert_the_frozen_worker_failed_the_copy_and_serves_again(outcome, peer_timeout_s):
    """Over tf_rdma the copy's eager call to the frozen worker fails when the connection ends, as
    any call to a peer silent for TF_RDMA_PEER_TIMEOUT_MS does, naming the worker (TensorFlow's
    coordinator retries a step failed so); the thawed worker takes the next copy."""
    to_frozen = outcome["to_frozen"]
    assert to_frozen.get("error") == "UnavailableError", outcome
    assert "/job:worker/replica:0/task:0" in to_frozen["message"], outcome
    assert outcome["again"] == float(1 << 18) and outcome["again_seconds"] < peer_timeout_s + 10, outcome


@pytest.mark.timeout(600)
def test_a_copy_to_a_worker_frozen_past_the_peer_timeout_does_not_stop_copies_to_the_others(tmp_path):
    """Found by the chaos run: the coordinator's write to a frozen worker failed when the peer timeout
    ended the connection, and that aborted the coordinator's eager rendezvous for good, so every later
    copy to any worker was dropped and the training waited for ever. Over gRPC the copy to the
    frozen worker waits for it and arrives once it runs again."""
    expected = float(1 << 18)
    peer_timeout_s = 2.0
    for transport in ("grpc", "rdma"):
        outcome = copies_around_a_frozen_worker(tmp_path, transport, peer_timeout_s)
        assert outcome["before"] == [expected, expected], (transport, outcome)
        assert outcome["after"] == expected and outcome["after_seconds"] < 30, (transport, outcome)
        if transport == "grpc":
            assert outcome["to_frozen"].get("sum") == expected and outcome["again"] == expected, outcome
        else:
            assert_the_frozen_worker_failed_the_copy_and_serves_again(outcome, peer_timeout_s)


@pytest.mark.timeout(600)
def test_a_worker_frozen_past_the_connect_timeout_serves_again_once_thawed(tmp_path):
    """Frozen longer than the peer timeout and TF_RDMA_CONNECT_TIMEOUT_MS together: the
    coordinator's dials meanwhile find the worker frozen and give up, and only the coordinator
    dials (its name sorts earlier). Once thawed, the worker is connected to again (it asks who
    serves the coordinator's address, which makes the coordinator dial back) and takes copies."""
    expected = float(1 << 18)
    peer_timeout_s, connect_timeout_s = 2.0, 12.0
    frozen_s = peer_timeout_s + connect_timeout_s + 2
    outcome = copies_around_a_frozen_worker(tmp_path, "rdma", peer_timeout_s, frozen_s, connect_timeout_s)
    assert outcome["before"] == [expected, expected], outcome
    assert outcome["after"] == expected and outcome["after_seconds"] < 30, outcome
    assert_the_frozen_worker_failed_the_copy_and_serves_again(outcome, peer_timeout_s)
