"""TF1 sessions across processes: tf_rdma gives bit-identical results to gRPC, carries the traffic,
and turns a missing or dead peer into a clear error instead of a hang."""
import json
import secrets
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from tests.harness import netns
from tests.tf.programs.cluster import Cluster, NamespacedCluster
from tests.tf.programs.tasks import DERIVED_DTYPES, STRINGS

TRANSPORTS = [("grpc", None), ("rdma", "tcp"), ("rdma", "shm")]


def run_pair(tmp_path, program, transport, backend, **kwargs):
    env = {"TF_RDMA_BACKEND": backend} if backend else {}
    output = str(tmp_path / f"{program}-{transport}-{backend}.npz")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, env) as cluster:
        cluster.start("ps", 0, "serve", transport=transport)
        cluster.start("worker", 0, program, transport=transport, output=output, **kwargs)
        code = cluster.wait("worker", 0, timeout=240)
        assert code == 0, cluster.log("worker", 0)[-4000:] + "\n--- ps ---\n" + cluster.log("ps", 0)[-2000:]
    with open(output + ".stats.json") as f:
        stats = json.load(f)
    return dict(np.load(output)), stats


def assert_bit_identical(reference, other):
    assert sorted(reference) == sorted(other)
    for key in reference:
        a, b = reference[key], other[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert a.tobytes() == b.tobytes(), key


def on_every_transport(tmp_path_factory, program, **kwargs):
    """{transport: (results, stats)}: `program` run by a worker beside a ps, on each transport."""
    tmp = tmp_path_factory.mktemp(program)
    return {t: run_pair(tmp, program, *t, **kwargs) for t in TRANSPORTS}


def identical_to_grpc(runs, transport):
    """The results and stats of `runs` over `transport`, its results checked bit for bit against gRPC's."""
    reference, _ = runs[("grpc", None)]
    results, stats = runs[transport]
    assert_bit_identical(reference, results)
    return results, stats


# Above half the largest slab of a receive pool (cc/tf/runtime/buffer_pool.cc): the big tensor gets
# a region of its own.
BIG_MIB = 64


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    return on_every_transport(tmp_path_factory, "compare_worker", big_mib=BIG_MIB)


# Above the sum of this test's own waits, so they fail first, with the tasks' logs. The module's
# compared and trained fixtures run three clusters (up to 240 s each) inside the first test using them.
THREE_CLUSTERS = pytest.mark.timeout(3 * 240 + 60)


@THREE_CLUSTERS
@pytest.mark.parametrize("transport", TRANSPORTS[1:], ids=lambda t: t[1])
def test_every_dtype_shape_and_control_flow_is_bit_identical_to_grpc(compared, transport):
    results, stats = identical_to_grpc(compared, transport)
    # And tf_rdma, not gRPC, carried it.
    peer = stats["peers"]["/job:ps/replica:0/task:0"]
    assert peer["backend"] == transport[1]
    assert peer["tensors_received"] > 0 and peer["tensors_sent"] > 0
    assert peer["bytes_received"] > BIG_MIB << 20
    assert peer["dead_tensors"] > 0, "the untaken cond branch must arrive as a dead tensor"
    # The ps's part of each step ran by a call on tf_rdma, not gRPC.
    assert peer["calls_made"].get("RunGraph", 0) > 0, peer
    assert peer["regrants"] > 0, "changing shapes must have grown a grant"
    assert stats["fallback"] == {}, "CPU tensors of every dtype, strings included, cross over tf_rdma"
    assert peer["bytes_received_by_kind"]["graph"] == peer["bytes_received"]
    # Every step, four threads at once: still the one connection of this task pair.
    assert peer["connects"] == 1, peer
    # Received buffers go back to the pool: none lent out once the results are dropped, and the
    # pool's regions, reused step after step, are a fraction of the bytes that landed in them.
    released = stats["receive_pools_released"][transport[1]]
    assert (released["buffers_in_use"], released["bytes_in_use"]) == (0, 0), released
    assert 0 < released["region_bytes"] < peer["bytes_received"] / 2, (released, peer)
    crossed = {name.split("/", 1)[1] for name in results}
    assert {f"derived_{d}" for d in DERIVED_DTYPES} | {"strings", "variant"} <= crossed


@THREE_CLUSTERS
@pytest.mark.parametrize("transport", TRANSPORTS[1:], ids=lambda t: t[1])
def test_strings_and_variants_cross_over_tf_rdma_serialized(compared, transport):
    _, stats = compared[transport]
    for name in ("strings", "variant"):
        # A step that moved that tensor alone, counted from reset_stats().
        alone = stats["crossings"][name]
        assert alone["fallback"] == {}, alone
        peer = alone["peers"]["/job:ps/replica:0/task:0"]
        assert (peer["tensors_received"], peer["tensors_sent"], peer["connects"]) == (1, 0, 0), peer
        # One grant, no regrant: a small tensor's bytes come inside its header's message, whose
        # grant holds them even though a proto's size is not planned from static shapes.
        assert (peer["grants"], peer["regrants"]) == (1, 0), peer
        assert peer["bytes_received_by_kind"] == {"graph": peer["bytes_received"]}, peer
    # Every byte of the strings, plus a serialization's few bytes of dtype, shape and lengths.
    received = stats["crossings"]["strings"]["peers"]["/job:ps/replica:0/task:0"]["bytes_received"]
    assert sum(map(len, STRINGS)) < received < sum(map(len, STRINGS)) + 64, received


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return on_every_transport(tmp_path_factory, "train_worker")


@THREE_CLUSTERS
@pytest.mark.parametrize("transport", TRANSPORTS[1:], ids=lambda t: t[1])
def test_ps_training_is_bit_identical_step_by_step(trained, transport):
    results, stats = identical_to_grpc(trained, transport)
    losses = [float(results[f"loss/{s}"]) for s in range(8)]
    assert losses[-1] < losses[0]
    ps = stats["peers"]["/job:ps/replica:0/task:0"]
    assert ps["bytes_sent"] > 0 and ps["bytes_received"] > 0
    # Every shape here is static, so the master's plan sized every receive buffer in advance: even
    # the first grant of each transfer fits (w1 and w2, 8 times in the training graph and once in
    # the final fetch's graph), and the steps after reuse the size learned.
    assert ps["tensors_received"] == 18, ps
    assert stats["receives_planned"] >= 4, stats
    assert ps["regrants"] == 0, ps


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return on_every_transport(tmp_path_factory, "fused_worker")


@THREE_CLUSTERS
@pytest.mark.parametrize("transport", TRANSPORTS[1:], ids=lambda t: t[1])
def test_small_static_tensors_cross_fused_one_message_each_way(fused, transport):
    results, stats = identical_to_grpc(fused, transport)
    assert results["both_ways/0/60"].shape == (8,), "the grown variable crossed whole"
    # One step: 61 reads come to the worker in one message, their 61 results go to the ps in one,
    # and the client's 61 fetches of what the ps made of them come back in one. Sources of one
    # message are equally many task boundaries deep, so no message waits for another's tensors.
    step = stats["both_ways"]["peers"]["/job:ps/replica:0/task:0"]
    assert (step["fused_messages_received"], step["fused_messages_sent"]) == (2, 1), step
    assert (step["tensors_received"], step["tensors_sent"]) == (122, 61), step
    # A grant per fused message received, and one for each crossing of the grown variable: larger
    # than its static shape planned, it travels on its own (twice to the worker, once to the ps).
    assert (step["grants"], step["regrants"], step["errors"]) == (4, 0, 0), step
    # The hops depend on each other across the tasks: only the reads that depend on nothing remote
    # share a message, and each hop travels alone.
    hops = stats["hops"]["peers"]["/job:ps/replica:0/task:0"]
    assert (hops["fused_messages_received"], hops["fused_messages_sent"]) == (1, 0), hops
    assert (hops["tensors_received"], hops["tensors_sent"]) == (6, 3), hops


def stalled_step(tmp_path, worker_transport="rdma", env=None, stop_ps=None, ps_options=None, **kwargs):
    """Runs programs.slow_ps_worker against an rdma ps (its server given `ps_options`); `stop_ps` (a
    signal) hits the ps while a step waits on it. Returns the step's outcome: error class, message,
    seconds."""
    output = str(tmp_path / "outcome.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, env) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma", **(ps_options or {}))
        cluster.start("worker", 0, "slow_ps_worker", transport=worker_transport, output=output, **kwargs)
        if stop_ps is not None:
            cluster.wait_for_output("worker", 0, "warm", timeout=120)
            time.sleep(0.5)
            cluster.signal("ps", 0, stop_ps)
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
    with open(output) as f:
        return json.load(f)


def test_task_without_tf_rdma_is_a_clear_error_within_seconds(tmp_path):
    outcome = stalled_step(tmp_path, worker_transport="grpc")
    assert outcome["error"] == "FailedPreconditionError", outcome
    assert "task /job:worker/replica:0/task:0 runs TensorFlow without tf_rdma" in outcome["message"]
    assert outcome["seconds"] < 20


@pytest.mark.timeout(180)
def test_a_step_whose_ps_froze_fails_as_unavailable_naming_the_ps_not_internal(tmp_path):
    """The worker sends to the ps once at the step's start and once after a pause in which the ps is
    frozen. The ps's part of the step (its RunGraph call, on tf_rdma) fails when the worker finds
    the ps silent, as gRPC fails a call to an unreachable task: UnavailableError naming the ps,
    which ParameterServerStrategy's coordinator and MonitoredSession recover from. Found by the
    chaos run before: the failed write's status reached the step's next _Send, which TensorFlow's
    executor turns into an InternalError, taken for the program's own bug."""
    output = str(tmp_path / "outcome.json")
    peer_timeout_s, connect_timeout_s, pause_s = 1.0, 2.0, 10.0
    env = {"TF_RDMA_PEER_TIMEOUT_MS": str(int(peer_timeout_s * 1000)),
           "TF_RDMA_CONNECT_TIMEOUT_MS": str(int(connect_timeout_s * 1000))}
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, env) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        worker = cluster.start("worker", 0, "sends_past_a_frozen_ps_worker", transport="rdma", output=output,
                               pause_s=pause_s, stdin=subprocess.PIPE)
        cluster.wait_for_output("worker", 0, "warm", timeout=120)
        cluster.signal("ps", 0, signal.SIGSTOP)
        worker.stdin.write(b"frozen\n")
        worker.stdin.flush()
        # The first send fails (the peer timeout, then the resend's wait for the ps to dial) well
        # before the second is made; the step's error then ends the session's run, the ps still
        # frozen.
        assert cluster.wait("worker", 0, timeout=pause_s + 30) == 0, cluster.log("worker", 0)[-3000:]
        cluster.signal("ps", 0, signal.SIGCONT)
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["error"] == "UnavailableError", (outcome, cluster.log("worker", 0)[-3000:])
    assert "/job:ps/replica:0/task:0" in outcome["message"], outcome


def test_a_step_whose_sends_were_given_up_fails_naming_the_ps_not_hangs(tmp_path):
    """The worker's part of the step makes both sends before the first fails (its sends are
    asynchronous, so that part ends at once). With the ps frozen past the peer timeout, and not
    dialling back within the connect timeout, the worker gives both messages up and its rendezvous
    is aborted; the master waits on the ps's part, whose RunGraph call fails with the connection it
    travelled on: UnavailableError naming the ps. Before (issue 27), session.run waited for ever
    on the ps's part."""
    output = str(tmp_path / "outcome.json")
    peer_timeout_s, connect_timeout_s = 1.0, 2.0
    env = {"TF_RDMA_PEER_TIMEOUT_MS": str(int(peer_timeout_s * 1000)),
           "TF_RDMA_CONNECT_TIMEOUT_MS": str(int(connect_timeout_s * 1000))}
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, env) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        worker = cluster.start("worker", 0, "sends_past_a_frozen_ps_worker", transport="rdma", output=output,
                               pause_s=0.1, stdin=subprocess.PIPE)
        cluster.wait_for_output("worker", 0, "warm", timeout=120)
        cluster.signal("ps", 0, signal.SIGSTOP)
        worker.stdin.write(b"frozen\n")
        worker.stdin.flush()
        # The step ends while the ps is still frozen.
        assert cluster.wait("worker", 0, timeout=peer_timeout_s + connect_timeout_s + 30) == 0, \
            cluster.log("worker", 0)[-3000:]
        cluster.signal("ps", 0, signal.SIGCONT)
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["error"] == "UnavailableError", (outcome, cluster.log("ps", 0)[-3000:])
    assert "/job:ps/replica:0/task:0" in outcome["message"], outcome
    assert outcome["seconds"] < peer_timeout_s + connect_timeout_s + 5, outcome


NO_NAMESPACES = netns.unavailable_reason("the ps and the worker run on hosts of their own (network namespaces)")


@pytest.mark.skipif(NO_NAMESPACES is not None, reason=NO_NAMESPACES or "")
@pytest.mark.parametrize("reader", ["ps", "worker"])
def test_explicit_shm_to_a_task_on_another_host_is_a_configuration_error(tmp_path, reader):
    # The step fails with the status choose_backend() and connect() raise as ConfigError
    # (tests/transport/test_backend_selection.py), InvalidArgument: TensorFlow's InvalidArgumentError.
    # The `reader` task reads the other's variable. The task with the smaller name (the ps)
    # connects and meets the error choosing the backend; the worker, which waits for it, says it
    # too, at once rather than after the connect timeout. Whichever part of the step fails first
    # names the other task's host.
    output = str(tmp_path / "outcome.json")
    with netns.Network() as net, \
            NamespacedCluster(tmp_path, net, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": "shm"}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        cluster.start("worker", 0, "cross_once", transport="rdma", output=output, reader=reader)
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
        hosts = {net.address("ps0"), net.address("worker0")}
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["error"] == "InvalidArgumentError", outcome
    assert any(f"TF_RDMA_BACKEND=shm but peer {host} is on another host" in outcome["message"]
               for host in hosts), outcome
    assert outcome["seconds"] < 20, outcome


class ClosingListener:
    """A port where something other than tf_rdma listens: it takes each connection and closes it
    at once, counting them."""

    def __init__(self):
        self.socket = socket.create_server(("localhost", 0))
        self.port = self.socket.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.socket.accept()
            except OSError:
                return
            self.accepted += 1
            client.close()

    def close(self):
        self.socket.close()


def test_a_peer_address_that_answers_and_hangs_up_is_retried_with_backoff_not_in_a_loop(tmp_path):
    """The ps dials the worker at an address where a listener hangs up on every connection: each
    try fails at once, so only backoff stands between the ps and thousands of connections a second
    (38,896 in 3 s without it) until TF_RDMA_CONNECT_TIMEOUT_MS. The step then fails as
    Unavailable. Over tcp: shm dials a Unix socket, not the TCP port the listener holds."""
    listener = ClosingListener()
    timeout_ms = 3000
    try:
        outcome = stalled_step(
            tmp_path, env={"TF_RDMA_CONNECT_TIMEOUT_MS": str(timeout_ms), "TF_RDMA_BACKEND": "tcp"},
            ps_options={"rdma_addresses": {"/job:worker/replica:0/task:0": f"localhost:{listener.port}"}})
    finally:
        listener.close()
    assert outcome["error"] == "UnavailableError", outcome
    # Each try is a connect and a probe of the port; backoff from 10 ms doubling to 500 ms gives
    # about 10 tries in 3 s.
    assert 2 <= listener.accepted <= 60, listener.accepted


def test_killed_peer_fails_the_step_promptly(tmp_path):
    outcome = stalled_step(tmp_path, stop_ps=signal.SIGKILL)
    assert outcome["error"] == "UnavailableError", outcome
    assert "/job:ps/replica:0/task:0" in outcome["message"]
    assert outcome["seconds"] < 10


def test_timed_out_step_releases_its_kernels(tmp_path):
    outcome = stalled_step(tmp_path, step_timeout_ms=2000)
    assert outcome["error"] == "DeadlineExceededError", outcome
    assert outcome["seconds"] < 10
    assert outcome["after"] == 2000.0


def test_hung_peer_fails_the_step_within_the_peer_timeout(tmp_path):
    outcome = stalled_step(tmp_path, env={"TF_RDMA_PEER_TIMEOUT_MS": "2000"}, stop_ps=signal.SIGSTOP)
    assert outcome["error"] == "UnavailableError", outcome
    assert "/job:ps/replica:0/task:0" in outcome["message"] and "unresponsive" in outcome["message"]
    assert outcome["seconds"] < 10


def test_sends_a_cancelled_step_never_asked_for_are_withdrawn_not_held(tmp_path, backend):
    """The worker's loop sends ps 0 a 1 MiB tensor per iteration; ps 0 blocks in the first and
    never issues the receives of the others, so never discards them. The worker's aborted step
    withdraws them: without that each stays in the connection (memory held) until it closes."""
    output = str(tmp_path / "outcome.json")
    steps = 4
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": backend}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        cluster.start("worker", 0, "run_ahead_cancelled_worker", transport="rdma", output=output, steps=steps)
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["cancelled"] == steps, outcome
    ps = outcome["stats"]["peers"]["/job:ps/replica:0/task:0"]
    from tests.harness.soak import RUN_AHEAD_ITERATIONS
    # Per step, the header and the data of each tensor but the first, which ps 0 received.
    assert ps["sends_discarded"] >= steps * (RUN_AHEAD_ITERATIONS - 1) * 2, ps
    assert ps["errors"] == 0, ps


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t[1] or t[0])
def test_a_partial_run_gets_each_call_its_tensors(tmp_path, transport):
    results, _ = run_pair(tmp_path, "partial_run_worker", *transport)
    assert results["first"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert results["second"].tolist() == [2.0, 5.0, 8.0, 11.0]


def test_a_fused_message_that_never_fills_is_taken_back_when_its_step_fails(tmp_path, backend):
    """The ps's fused message waits for a member that never comes (a dequeue from an empty queue):
    the worker's grant for it must be taken back when the step times out, not held, and the next
    step's message must come whole."""
    output = str(tmp_path / "outcome.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": backend}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        cluster.start("worker", 0, "fused_stall_worker", transport="rdma", output=output)
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["errors"] == ["DeadlineExceededError"] * 3, outcome
    assert outcome["value"] == 64 * (0 + 1 + 2), outcome
    stats = outcome["stats"]
    ps = stats["peers"]["/job:ps/replica:0/task:0"]
    # Granted by every step, landed for the two that completed.
    assert (ps["grants"], ps["fused_messages_received"]) == (5, 2), ps
    pool = stats["receive_pools"][backend]
    assert (pool["buffers_in_use"], pool["bytes_in_use"]) == (0, 0), pool
    assert stats["live_steps"] <= 1, stats


def test_ended_steps_leave_no_rendezvous_alive(tmp_path, backend):
    """TensorFlow keeps every step rendezvous it aborts for the life of the process, and its
    cleanup aborts any still held, if only for a moment: a long run's memory grew with them. After
    cancelled steps and hundreds of completed ones, no step but the last may still be alive on
    either task, apart from the cancelled ones, which TensorFlow keeps whatever the transport."""
    output = str(tmp_path / "outcome.json")
    ps_stats = str(tmp_path / "ps_stats.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": backend}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma", stats_file=ps_stats)
        cluster.start("worker", 0, "run_ahead_cancelled_worker", transport="rdma", output=output, steps=4,
                      completed_steps=1000)
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
        ps = cluster.stats_dumped_after(ps_stats, time.time())
    with open(output) as f:
        worker = json.load(f)["stats"]
    assert worker["live_steps"] <= 1, worker
    assert worker["failed_steps_kept"] == 4, worker
    assert ps["live_steps"] <= 1, ps


def cross_with_secrets(tmp_path, ps_secret, worker_secret):
    """programs.cross_once on a worker whose TF_RDMA_SECRET may differ from the ps's; its outcome."""
    output = str(tmp_path / "outcome.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, {"TF_RDMA_CONNECT_TIMEOUT_MS": "10000"}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma", env={"TF_RDMA_SECRET": ps_secret})
        cluster.start("worker", 0, "cross_once", transport="rdma", output=output,
                      env={"TF_RDMA_SECRET": worker_secret})
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
        ps_log = cluster.log("ps", 0)
    with open(output) as f:
        return json.load(f), ps_log


# Secrets as `python -m tf_rdma secret` makes them: tf_rdma refuses weak ones.
ALPHA, BETA = secrets.token_urlsafe(32), secrets.token_urlsafe(32)


def test_tasks_sharing_a_secret_exchange_tensors(tmp_path):
    outcome, _ = cross_with_secrets(tmp_path, ALPHA, ALPHA)
    assert outcome["error"] is None and outcome["sum"] == 2 * sum(range(1000)), outcome
    assert outcome["stats"]["peers"]["/job:ps/replica:0/task:0"]["bytes_received"] >= 4000, outcome


def test_a_task_with_another_secret_is_refused(tmp_path):
    outcome, ps_log = cross_with_secrets(tmp_path, ALPHA, BETA)
    assert outcome["error"] is not None, outcome
    assert "cluster key mismatch" in outcome["message"] + ps_log, (outcome, ps_log[-3000:])
    assert outcome["stats"]["peers"].get("/job:ps/replica:0/task:0", {}).get("bytes_received", 0) == 0, outcome
