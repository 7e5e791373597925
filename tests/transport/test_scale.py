"""A receiver serving hundreds of peers: a few threads whatever their number, little memory per
idle peer, connection storms and silent sockets that do not lock peers out (issue 26). Also where
callbacks run (transport.h: which thread runs which callback)."""
import contextlib
import socket
import struct
import time

import pytest

from tests.transport.helpers import HOST, KEY, connected_pair, pattern, raises_exactly, transport
from tf_rdma import _transport, errors
from tf_rdma.bench import scale as bench_scale

# verbs runs in the Soft-RoCE guest, under emulation: fewer peers there, enough that a thread per
# peer (as each verbs connection had before) would show.
PEERS = {"tcp": 512, "shm": 512, "verbs": 32}
# The fairness test's measured window. Its 256 peers are 16 sender transports of one I/O thread each
# in the test's process, beside the receiver's 2, on 2 cores: over two seconds the scheduler's turns
# between those threads showed as unfairness now and then (0.43 once in a full test run; the least
# served peers often come in a sender's block of 16). The turn policy's unfairness this guards
# against is steady (0.14-0.39, docs/scale.md) and shows over any window.
FAIRNESS_WINDOW_S = 4


def test_grant_callbacks_run_on_a_transport_thread_unless_refused_at_once(backend):
    with connected_pair(backend) as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(4096)
        landed = from_sender.grant(1, region, 0, 64)
        assert not landed.done()
        written = to_receiver.write(1, b"\x07" * 64)
        assert landed.wait(10) == 64
        written.wait(10)
        assert not landed.completed_inside_call, "a grant's data landing ran its callback inside a call"

        # A write waiting for its grant completes when the grant arrives: on a transport thread.
        waiting = to_receiver.write(2, b"\x08" * 64)
        assert not waiting.done()
        second = from_sender.grant(2, region, 64, 64)
        waiting.wait(10)
        assert second.wait(10) == 64
        assert not waiting.completed_inside_call and not second.completed_inside_call

        revoked = from_sender.grant(3, region, 128, 64)
        from_sender.revoke(revoked)
        with raises_exactly(errors.CancelledError, match="grant revoked"):
            revoked.wait(10)
        assert not revoked.completed_inside_call, "Revoke ran the grant's callback itself"

        # Refused at once: the one case where Grant runs the callback before it returns.
        from_sender.close()
        refused = from_sender.grant(4, region, 0, 64)
        assert refused.done() and refused.completed_inside_call


@pytest.mark.stream_backends_only
def test_silent_sockets_do_not_lock_peers_out(backend):
    """1,000 sockets that connect and send nothing hold no handshake slot: peers connect past
    them, and the listener drops them after its first-byte deadline."""
    receiver = transport(backend, "receiver", connect_timeout=30)
    listener = receiver.listen(f"{HOST}:0")
    port = int(listener.endpoint.rsplit(":", 1)[1])
    silent = []
    try:
        for _ in range(1000):
            if backend == "shm":
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(f"\0tf_rdma-shm-{port}")
            else:
                s = socket.create_connection((HOST, port))
            silent.append(s)
        started = time.monotonic()
        member = transport(backend, "member", connect_timeout=30)
        connections = [member.connect(listener.endpoint) for _ in range(8)]
        assert [listener.accept(5).peer_name for _ in connections] == ["member"] * 8
        assert time.monotonic() - started < 2, "peers waited behind silent sockets"
        # The silent ones are let go of (first-byte deadline, 2 s): each reads its end.
        for s in silent[:20]:
            s.settimeout(10)
            while s.recv(4096):
                pass
    finally:
        for s in silent:
            s.close()


@contextlib.contextmanager
def receiver_process(backend):
    """scale_receiver.py in a process of its own."""
    receiver = bench_scale.ReceiverProcess(backend, KEY, HOST, module="tests.transport.scale_receiver")
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.mark.timeout(240)
def test_hundreds_of_peers_connect_at_once(backend):
    """512 peers (verbs: 32) connect to one receiver at once: all connect (refusals for the
    handshake limit are retried), the receiver runs at most 16 threads, no more than before its
    first peer but for a few, spends at most 64 KiB of RSS and one descriptor per idle peer (tcp,
    shm), and every peer's message lands exact."""
    peers = PEERS[backend]
    with receiver_process(backend) as receiver:
        senders, connections, _ = bench_scale.connect_peers(backend, receiver.start["endpoint"], peers, KEY)
        idle = receiver.ask("accept", peers)
        # A few: handshake threads that are still on their way out.
        assert idle["threads"] <= min(16, receiver.start["threads"] + 4), (receiver.start, idle)
        if backend != "verbs":  # a queue pair holds 4 descriptors and ~1 MiB of buffers, idle or not
            assert idle["fds"] - receiver.start["fds"] <= peers, idle
            per_peer = (idle["rss"] - receiver.start["rss"]) / peers
            assert per_peer <= 64 << 10, f"{per_peer / 1024:.1f} KiB of RSS per idle peer"

        size = 256
        receiver.send("receive", size)
        writes = [c.write(1, struct.pack("<Q", i) + pattern(size - 8, i)) for i, c in enumerate(connections)]
        landed = receiver.answer()
        assert sorted(landed["indices"]) == list(range(peers))
        for write in writes:
            write.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.stream_backends_only  # the fairness target is shm's (and tcp's)
def test_peers_writing_at_once_get_fair_shares(backend):
    """256 peers write 64 KiB messages to one receiver as fast as it grants: over four seconds, the
    peer that moved least moved at least half as much as the one that moved most."""
    peers, size = 256, 64 << 10
    with receiver_process(backend) as receiver:
        senders, connections, _ = bench_scale.connect_peers(backend, receiver.start["endpoint"], peers, KEY)
        receiver.ask("accept", peers)
        writing = _transport.SteadyFlow("send", connections, size=size)
        try:
            shares = receiver.ask("flow", size, FAIRNESS_WINDOW_S)
        finally:
            writing.stop(30)
        moved = shares["bytes"]
        assert len(moved) == peers
        fairness = bench_scale.fairness(moved)
        assert fairness >= 0.5, (f"min/max bytes per peer {fairness:.2f} (min {min(moved)}, max {max(moved)}, "
                                 f"{sum(moved) / shares['seconds'] / 1e9:.2f} GB/s in all)")
