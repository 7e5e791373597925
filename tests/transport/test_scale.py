"""A receiver serving hundreds of peers: a few threads whatever their number, little memory per
idle peer, connection storms and silent sockets that do not lock peers out (issue 26). Also where
callbacks run (transport.h: which thread runs which callback)."""
import concurrent.futures
import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import HOST, connected_pair, pattern, transport
from tf_rdma import errors

PEERS = 512
RECEIVER_SCRIPT = Path(__file__).with_name("scale_receiver.py")


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
        with pytest.raises(errors.TransportError):
            revoked.wait(10)
        assert not revoked.completed_inside_call, "Revoke ran the grant's callback itself"

        # Refused at once: the one case where Grant runs the callback before it returns.
        from_sender.close()
        refused = from_sender.grant(4, region, 0, 64)
        assert refused.done() and refused.completed_inside_call


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


@pytest.mark.timeout(240)
def test_hundreds_of_peers_connect_at_once(backend):
    """512 peers connect to one receiver at once: all connect (refusals for the handshake limit are
    retried), the receiver runs at most 16 threads, spends at most 64 KiB of RSS and one descriptor
    per idle peer, and every peer's message lands exact."""
    receiver = subprocess.Popen([sys.executable, str(RECEIVER_SCRIPT), backend], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        start = json.loads(receiver.stdout.readline())
        # Peers of distinct names, each within TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME (16) connections.
        per_name = 16
        senders = [transport(backend, f"sender-{i}", connect_timeout=60, io_threads=1)
                   for i in range(PEERS // per_name)]
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            connections = list(pool.map(lambda i: senders[i // per_name].connect(start["endpoint"]), range(PEERS)))
        receiver.stdin.write(f"accept {PEERS}\n")
        receiver.stdin.flush()
        idle = json.loads(receiver.stdout.readline())
        assert idle["threads"] <= 16, idle
        assert idle["fds"] - start["fds"] <= PEERS, idle
        per_peer = (idle["rss"] - start["rss"]) / PEERS
        assert per_peer <= 64 << 10, f"{per_peer / 1024:.1f} KiB of RSS per idle peer"

        size = 256
        receiver.stdin.write(f"receive {size}\n")
        receiver.stdin.flush()
        writes = [c.write(1, struct.pack("<Q", i) + pattern(size - 8, i)) for i, c in enumerate(connections)]
        landed = json.loads(receiver.stdout.readline())
        assert "error" not in landed, landed["error"]
        assert sorted(landed["indices"]) == list(range(PEERS))
        for write in writes:
            write.wait(10)
    finally:
        receiver.kill()
        receiver.wait()
