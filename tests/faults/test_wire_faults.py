"""Faults on the wire, tf_rdma (tcp backend) beside stock gRPC under the same faults: a TF1 ps and
worker, each in its own network namespace (tests/harness/netns.py), the worker driven step by step
(wire_programs.driven_worker) while the test partitions their link, loses, delays, duplicates and
rate-limits packets on it, freezes the ps, and makes the ps's host vanish (no FIN) and come back
on the same address.

One cluster per transport plays the whole schedule (TensorFlow's start-up dominates a run), which
`schedules` records; each test asserts one behaviour on it, tf_rdma's against gRPC's. The
schedule's phases run in order on live connections, so each phase also starts from the aftermath
of the one before, as in a real cluster.

No netem on this kernel: loss and partitions are nftables drops, delay and jitter an NFQUEUE rule
and a userspace delayer on the link, duplication an nftables `dup` and the rate a token bucket on
the switch's ports (tests/harness/netns.py), so each direction meets each once."""
import json
import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import netns
from tests.tf.programs.cluster import PROGRAMS, NamespacedCluster, digest
from tests.transport.helpers import socket_inodes

PROGRAM = Path(__file__).with_name("wire_programs.py")
PS = "/job:ps/replica:0/task:0"
PEER_TIMEOUT_S = 3.0
# From the fault to the worker's step failing, beyond the peer timeout: the heartbeat's receive
# timeout runs from the last byte received (before the fault), then the step's abort crosses
# TensorFlow's executors.
SLACK_S = 2.5
# Every step's RunOptions deadline: what ends a step gRPC never fails on its own.
OP_TIMEOUT_S = 6.0
# Long faults outlast both the peer timeout and the step deadline.
LONG_FAULT_S = 8.0
# Short enough that TCP's retransmission backoff (0.2, 0.4, 0.8 s...) resends within the peer
# timeout after the heal: a partition of p is seen to end up to ~p later.
SHORT_PARTITION_S = 1.0
STEPS = 400
# From lifting a fault to the worker's first good probe: a healed link and a thawed ps at once; a
# restarted ps after its start (TensorFlow's import, seconds on a busy machine).
RECOVERY_S = {"long_partition": LONG_FAULT_S + 2, "frozen": 1.0, "restarted": 30.0}
# The impaired link: both directions lose LOSS_PERCENT% of packets, delay each by DELAY_MS ±
# JITTER_MS (uniform), duplicate DUPLICATE_PERCENT% and are capped at RATE_MBIT. A step waits for
# several round trips of 30-50 ms, so that phase runs fewer steps than the others (against an
# unimpaired run of as many, in the same processes). The cap is under what a veth carries but
# does not set the step time: through the same loss, delay and duplication one TCP connection
# moved 336-404 Mbit/s uncapped, 318-373 capped at 1,000, 235-256 at 400 (4 s each, three runs),
# and an all-reduce step (4 MiB each way in 240-480 ms) averages about 100 Mbit/s.
LOSS_PERCENT, DELAY_MS, JITTER_MS, DUPLICATE_PERCENT, RATE_MBIT = 1, 20, 5, 1, 1000
IMPAIRED_STEPS = 40
IMPAIRMENT = (f"{LOSS_PERCENT}% loss, {DELAY_MS} ± {JITTER_MS} ms, {DUPLICATE_PERCENT}% duplicated, "
              f"{RATE_MBIT} Mbit/s")

NEEDS = netns.unavailable_reason("each task runs in its own network namespace, faults are nftables rules")
pytestmark = pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")


class Driver:
    """Talks to a driven_worker: sends commands, reads its JSON answers from its log."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.process = cluster.processes[("worker", 0)]
        self.seen = 0

    def send(self, line):
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def answer(self, *keys, timeout, none_ok=False):
        """The next answer holding one of `keys` (earlier answers skipped); with `none_ok`, if
        none comes in time, {"error": "no answer"} (the worker still busy with the command)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [l for l in self.cluster.log("worker", 0).splitlines() if l.startswith("{")]
            for number in range(self.seen, len(lines)):
                message = json.loads(lines[number])
                if any(k in message for k in keys):
                    self.seen = number + 1
                    return message
            if time.monotonic() > deadline:
                assert none_ok, (keys, self.cluster.log("worker", 0)[-3000:])
                return {"error": "no answer", "waited_s": timeout}
            assert self.process.poll() is None, self.cluster.log("worker", 0)[-3000:]
            time.sleep(0.05)

    def command(self, line, timeout=OP_TIMEOUT_S * 3, none_ok=False):
        self.send(line)
        return self.answer("trained", "probe", "init", "renew", "error", timeout=timeout, none_ok=none_ok)

    def until_success(self, lines, within):
        """Repeats `lines` until the last one succeeds (the cluster recovering), or `within`
        seconds pass; the answers. A command left without answer ends it: the worker is stuck."""
        deadline = time.monotonic() + within
        answers = []
        while not answers or "error" in answers[-1] and time.monotonic() < deadline:
            for line in lines:
                answers.append(self.command(line, max(1.0, deadline - time.monotonic()), none_ok=True))
                if answers[-1].get("error") == "no answer":
                    return answers
        return answers


TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
              6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}


def rdma_sockets_to(pid, address, ports):
    """The TCP sockets process `pid` holds a descriptor of between it and `address` on one of
    `ports` (either end), tf_rdma's connections to that host: [(inode, local port, remote port,
    state)]. A socket that reached CLOSE leaves /proc/net/tcp: follow a connection by its inode
    in /proc/PID/fd (socket_inodes) once it was seen here."""
    inodes = socket_inodes(pid)
    peer = socket.inet_aton(address)[::-1].hex().upper()  # /proc/net/tcp: little-endian hex
    found = []
    with open(f"/proc/{pid}/net/tcp") as f:
        for row in f.readlines()[1:]:
            fields = row.split()
            local_port = int(fields[1].split(":")[1], 16)
            remote_ip, remote_port = fields[2].split(":")
            if fields[9] in inodes and remote_ip == peer and (
                    local_port in ports or int(remote_port, 16) in ports):
                found.append((fields[9], local_port, int(remote_port, 16), TCP_STATES[int(fields[3], 16)]))
    return found


class ConnectionsToPs:
    """The worker's tf_rdma connections to the ps's host (tcp; shm's Unix sockets are not listed)."""

    def __init__(self, worker_pid, ps_address, rdma_ports):
        self.pid, self.address, self.ports = worker_pid, ps_address, rdma_ports

    def listed(self):
        return rdma_sockets_to(self.pid, self.address, self.ports)

    def held(self, inodes):
        return socket_inodes(self.pid) & set(inodes)


def play(tmp_path, transport, backend="tcp"):
    """The schedule over `transport` (tf_rdma's over `backend`); returns what each phase did.
    Over shm, both tasks share a host and the wire's phases are left out."""
    env = {"TF_RDMA_PEER_TIMEOUT_MS": str(int(PEER_TIMEOUT_S * 1000)), "TF_RDMA_BACKEND": backend}
    offset = int(os.environ.get("TF_RDMA_PORT_OFFSET", "1000"))
    wire = backend == "tcp"
    record = {}
    (tmp_path / f"{transport}-{backend}").mkdir()
    with netns.Network() as net, \
            NamespacedCluster(tmp_path / f"{transport}-{backend}", net, {"ps": 1, "worker": 1}, env,
                              one_host=None if wire else "host") as cluster:
        cluster.start("ps", 0, "serve", program=PROGRAM, transport=transport)
        cluster.start("worker", 0, "driven_worker", program=PROGRAM, stdin=subprocess.PIPE,
                      transport=transport, op_timeout_ms=int(OP_TIMEOUT_S * 1000))
        worker = Driver(cluster)
        worker.answer("ready", timeout=180)
        record["init"] = worker.until_success(["init"], within=60)[-1]
        record["reference"] = worker.command(f"train {STEPS}")
        ps_host = cluster.host("ps", 0)
        rdma_ports = {int(a.rsplit(":", 1)[1]) + offset for addresses in cluster.spec.values() for a in addresses}
        ps_address = net.address(ps_host)

        to_ps = ConnectionsToPs(worker.process.pid, ps_address, rdma_ports)

        if wire:
            wire_faults(worker, net, record, to_ps)

        # The ps frozen (SIGSTOP) for as long, then thawed.
        record["frozen"] = long_fault(
            worker, lambda: cluster.signal("ps", 0, signal.SIGSTOP),
            lambda: cluster.signal("ps", 0, signal.SIGCONT), to_ps)

        # The ps killed (its connections end: FIN) and a new one started on the same address after
        # LONG_FAULT_S. TensorFlow's recovery from a restarted ps (its session gone: AbortedError),
        # as MonitoredSession's: a new session, the variables set again.
        def kill_ps():
            cluster.signal("ps", 0, signal.SIGKILL)
            cluster.wait("ps", 0, timeout=30)

        record["restarted"] = long_fault(
            worker, kill_ps, lambda: cluster.start("ps", 0, "serve", program=PROGRAM, transport=transport),
            to_ps, recover=("renew", "init"))

        if wire:
            # The ps's host vanishes: its link first, so its death sends no FIN, then its
            # namespace. The worker's connections to it are half-open. (No recovery: a half-open
            # gRPC channel holds TensorFlow's next session for 40 s and more, whatever carries
            # the tensors.)
            def vanish():
                net.cut_off(ps_host)
                kill_ps()
                net.remove_host(ps_host)

            record["vanished"] = long_fault(worker, vanish, None, to_ps)
    return record


def wire_faults(worker, net, record, to_ps):
    """The link's faults, between the ps's and the worker's hosts."""
    # A partition shorter than the peer timeout, while a step runs.
    worker.command("init")
    worker.send(f"train {STEPS} 10")
    worker.answer("paused", timeout=30)
    net.partition("ps0", "worker0")
    worker.send("go")
    time.sleep(SHORT_PARTITION_S)
    net.heal("ps0", "worker0")
    record["short_partition"] = worker.answer("trained", "error", timeout=OP_TIMEOUT_S * 2 + STEPS)

    # The link impaired for a whole training run, after an unimpaired one as long.
    worker.command("init")
    record["unimpaired"] = worker.command(f"train {IMPAIRED_STEPS}")
    worker.command("init")
    impair(net)
    record["impaired"] = worker.command(f"train {IMPAIRED_STEPS}", timeout=IMPAIRED_STEPS * OP_TIMEOUT_S)
    unimpair(net)

    # A partition longer than the peer timeout and the step deadline; then healed.
    record["long_partition"] = long_fault(
        worker, lambda: net.partition("ps0", "worker0"), lambda: net.heal("ps0", "worker0"),
        to_ps)


def impair(net):
    net.lose(LOSS_PERCENT)
    net.delay(DELAY_MS, JITTER_MS)
    net.duplicate(DUPLICATE_PERCENT)
    net.limit_rate(RATE_MBIT)


def unimpair(net):
    net.unlimit_rate()
    net.stop_duplicating()
    net.undelay()
    net.keep_all()


def long_fault(worker, apply, lift, to_ps, recover=("probe",)):
    """Five steps, then the fault, and the sixth step in it; holds the fault LONG_FAULT_S, lifts
    it (unless `lift` is None), then repeats `recover` until it works. Returns the sixth step's
    answer (an error, or "trained" if it rode the fault out), the seconds from the fault to it,
    when tf_rdma's connection to the ps released its descriptor, and the recovery's answers."""
    connections = to_ps.listed()
    worker.send("train 6 5")
    worker.answer("paused", timeout=30)
    apply()
    applied = time.time()
    worker.send("go")
    outcome = worker.answer("trained", "error", timeout=LONG_FAULT_S + 3 * OP_TIMEOUT_S)
    failed = outcome.get("failed_at", time.time())
    outcome["after_fault_s"] = failed - applied
    outcome["connections_before"] = connections
    old = {c[0] for c in connections}
    while to_ps.held(old) and time.time() < failed + PEER_TIMEOUT_S:
        time.sleep(0.1)
    outcome["old_connection_released_after_failure_s"] = None if to_ps.held(old) else time.time() - failed
    if lift is None:
        return outcome
    time.sleep(max(0.0, applied + LONG_FAULT_S - time.time()))
    lift()
    lifted = time.monotonic()
    answers = worker.until_success(recover, within=60)
    if "probe" not in recover and "error" not in answers[-1]:
        answers.append(worker.command("probe"))
    outcome["recovery"] = answers
    outcome["recovered_after_lift_s"] = time.monotonic() - lifted
    outcome["old_connection_held_after_recovery"] = bool(to_ps.held(old))
    return outcome


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """gRPC's and tf_rdma's (tcp) runs of the whole schedule, and tf_rdma's over shm (two tasks on
    one host: no wire, but a frozen or restarted peer)."""
    tmp_path = tmp_path_factory.mktemp("wire_faults")
    runs = {"grpc": play(tmp_path, "grpc"), "rdma": play(tmp_path, "rdma"),
            "rdma-shm": play(tmp_path, "rdma", backend="shm")}
    print(json.dumps(runs, indent=1))  # what each did, for the record (pytest -s)
    rates = {t: IMPAIRED_STEPS / runs[t]["impaired"]["seconds"] for t in ("grpc", "rdma")
             if "digest" in runs[t]["impaired"]}  # an error fails the tests below
    if len(rates) == 2:
        print(json.dumps({"impairment": IMPAIRMENT, "steps": IMPAIRED_STEPS, "steps_per_s": rates,
                          "rdma_to_grpc": rates["rdma"] / rates["grpc"]}))
    return runs


def ours(schedules, phase, backend):
    return schedules["rdma" if backend == "tcp" else f"rdma-{backend}"][phase]


def test_both_train_identically_unimpaired(schedules):
    digests = {name: run["reference"]["digest"] for name, run in schedules.items()}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("phase, reference", [("short_partition", "reference"), ("impaired", "unimpaired")])
def test_a_short_partition_and_an_impaired_link_lose_no_step_and_change_no_result(schedules, phase, reference):
    for transport in ("grpc", "rdma"):
        run = schedules[transport]
        assert "error" not in run[phase], (transport, run[phase])
        assert run[phase]["digest"] == run[reference]["digest"], (transport, run)
    assert schedules["rdma"]["unimpaired"]["digest"] == schedules["grpc"]["unimpaired"]["digest"]


def test_impaired_step_rate_against_grpc(schedules):
    """On the impaired link a step takes a few round trips of 30-50 ms, and a lost packet's
    retransmission timeout (200 ms and up) more, so the rate varies from run to run: the
    bound catches a transport that stalls on an impaired link, not a few percent."""
    rate = {t: IMPAIRED_STEPS / schedules[t]["impaired"]["seconds"] for t in ("grpc", "rdma")}
    clean = {t: IMPAIRED_STEPS / schedules[t]["unimpaired"]["seconds"] for t in ("grpc", "rdma")}
    print(f"steps/s under {IMPAIRMENT}: rdma {rate['rdma']:.1f}, grpc {rate['grpc']:.1f} "
          f"(ratio {rate['rdma'] / rate['grpc']:.2f}); unimpaired: rdma {clean['rdma']:.1f}, "
          f"grpc {clean['grpc']:.1f}")
    assert rate["rdma"] > 0.4 * rate["grpc"], (rate, clean)


@pytest.mark.parametrize("phase, rdma_backend", [("long_partition", "tcp"), ("frozen", "tcp"), ("frozen", "shm"),
                                            ("restarted", "tcp"), ("restarted", "shm"), ("vanished", "tcp")])
def test_a_lost_peer_fails_the_step_within_the_peer_timeout(schedules, phase, rdma_backend):
    run, stock = ours(schedules, phase, rdma_backend), schedules["grpc"][phase]
    assert run.get("error") == "UnavailableError", run
    assert PS in run["message"], run
    assert run["after_fault_s"] < PEER_TIMEOUT_S + SLACK_S, run
    # gRPC has no peer timeout of its own: the step's deadline ends it (a killed ps: at once).
    assert stock.get("error") in ("DeadlineExceededError", "UnavailableError"), stock


@pytest.mark.parametrize("phase", ["long_partition", "frozen", "restarted"])
def test_a_peer_back_is_used_again_over_a_new_connection(schedules, phase):
    """Once the link heals, the ps thaws or a new one runs on its address, the next operations work
    with every byte right, and the old connection is gone (it neither delivers nor blocks)."""
    for name, schedule in schedules.items():
        if phase in schedule:
            run = schedule[phase]
            assert run["recovery"][-1].get("probe") is True, (name, run)
            assert run["recovered_after_lift_s"] < RECOVERY_S[phase], (name, run)
    assert not schedules["rdma"][phase]["old_connection_held_after_recovery"], schedules["rdma"][phase]


@pytest.mark.parametrize("phase", ["long_partition", "frozen", "restarted", "vanished"])
def test_a_dead_connection_releases_its_descriptor_within_the_peer_timeout(schedules, phase):
    run = schedules["rdma"][phase]
    assert run["connections_before"], run
    assert run["old_connection_released_after_failure_s"] is not None, run


MWMS_PROGRAM = PROGRAMS / "collective.py"
MWMS_STEPS, MWMS_ELEMENTS = 40, 1 << 20


def mwms_all_reduces(tmp_path, transport, impaired):
    """Two MultiWorkerMirroredStrategy workers on hosts of their own, all-reducing a vector of
    MWMS_ELEMENTS floats MWMS_STEPS times, `impaired`: with the link impaired (impair()) from the
    start; the digest of every result, and the seconds of each step after the first (the slower
    worker's)."""
    run_dir = tmp_path / f"mwms-{transport}-{'impaired' if impaired else 'unimpaired'}"
    run_dir.mkdir()
    outputs = [str(run_dir / f"worker{i}.npz") for i in range(2)]
    env = {"TF_RDMA_PEER_TIMEOUT_MS": str(int(PEER_TIMEOUT_S * 1000)), "TF_RDMA_BACKEND": "tcp"}
    with netns.Network() as net, NamespacedCluster(run_dir, net, {"worker": 2}, env) as cluster:
        if impaired:
            impair(net)
        for i in range(2):
            cluster.start("worker", i, "all_reduce_worker", program=MWMS_PROGRAM, transport=transport,
                          output=outputs[i], steps=MWMS_STEPS, elements=MWMS_ELEMENTS)
        for i in range(2):
            assert cluster.wait("worker", i, timeout=240) == 0, cluster.log("worker", i)[-4000:]
    steps = [json.loads(Path(o + ".seconds").read_text()) for o in outputs]
    return [digest(o) for o in outputs], [max(both) for both in zip(*steps)]


@pytest.mark.timeout(3 * 2 * 240 + 60)
def test_multi_worker_mirrored_all_reduces_on_an_impaired_link_are_identical_to_unimpaired(tmp_path):
    """The impaired link between the workers changes no bit of any all-reduce, over gRPC and
    tf_rdma; tf_rdma's step rate so impaired is gRPC's. Compared by the median step: a lost
    packet's retransmission (200 ms, doubling while it is lost again) lengthens a few steps of
    either transport by up to seconds, so the totals of runs of one transport differ by up to 2x.
    A step stalled past twice the peer timeout is no retransmission: it fails the test."""
    reference, _ = mwms_all_reduces(tmp_path, "grpc", False)
    stock, stock_steps = mwms_all_reduces(tmp_path, "grpc", True)
    ours, steps = mwms_all_reduces(tmp_path, "rdma", True)
    assert stock == reference and ours == reference, (reference, stock, ours)
    median, stock_median = statistics.median(steps), statistics.median(stock_steps)
    print(f"MultiWorkerMirrored, {MWMS_STEPS - 1} all-reduces of {MWMS_ELEMENTS * 4 >> 10} KiB under "
          f"{IMPAIRMENT}: median step rdma {median:.3f} s, grpc {stock_median:.3f} s (rate ratio "
          f"{stock_median / median:.2f}); slowest rdma {max(steps):.2f} s, grpc {max(stock_steps):.2f} s")
    assert median < stock_median / 0.6, (steps, stock_steps)
    assert max(steps) < 2 * PEER_TIMEOUT_S, (steps, stock_steps)
