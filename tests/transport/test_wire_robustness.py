"""Hostile and broken peers on the stream backends' wire: every malformed, truncated or out-of-bounds
frame closes that one connection with a ProtocolError naming the problem; no memory is touched,
the process survives and the listener keeps serving."""
import contextlib
import os
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from tests.transport import wire_client as w
from tests.transport.helpers import HOST, KEY, listening_child, raises_exactly, raw_peer_connected, transport
from tf_rdma import errors
from tf_rdma._transport import _testing

pytestmark = pytest.mark.stream_backends_only


@pytest.fixture
def server(backend):
    receiver = transport(backend, "receiver")
    listener = receiver.listen(f"{HOST}:0")
    yield receiver, listener
    # The listener still serves members after whatever the test did.
    member = transport(backend, "member")
    member.connect(listener.endpoint)
    assert listener.accept(10).peer_name == "member"


def attack(backend, server, frames, expected):
    receiver, listener = server
    raw = w.RawPeer(backend, listener.endpoint)
    raw.handshake(KEY)
    connection = listener.accept(10)
    region = receiver.allocate_region(4096)
    memoryview(region)[:] = b"\x5a" * 4096
    pending = connection.grant(77, region, 0, 100)
    if callable(frames):
        frames(raw)
    else:
        raw.send(b"".join(frames))
    with raises_exactly(errors.ProtocolError, match=expected):
        pending.wait(10)
    with raises_exactly(errors.ProtocolError):
        connection.check()
    reason = raw.receive_until_closed()
    assert reason is not None and "broke the tf_rdma protocol" in reason
    assert memoryview(region) == b"\x5a" * 4096, "a rejected frame must not touch memory"
    raw.close()


CASES = {
    "unknown frame type": [w.frame(99)],
    "reserved bytes are not zero": [w.frame(w.PING, reserved=b"\0\1\0")],
    "exceeds the limit": [w.frame(w.PING, length=1 << 20)],
    "truncated": [w.frame(w.GRANT, b"\1" * 10)],
    "trailing bytes": [w.frame(w.PING, b"\0")],
    "not outstanding": [w.data(12345, 10) + b"\0" * 10],
    "DATA of 1000 bytes for a grant of 100": [w.data(1, 1000) + b"\1" * 1000],
    "fits the grant": [w.too_small(1, 50)],
    "unexpected HELLO": [w.frame(w.HELLO, w.greeting(1, "tcp", b"\0" * 32, "again"))],
    # The grant (id 1) is outstanding, but the receiver never asked for it back.
    "REVOKED for grant 1, which was never revoked": [w.revoked(1)],
    # A sender may withdraw only a message a grant of ours waits for, with an error code and a
    # bounded reason.
    "WITHDRAWN for grant 12345, which is not outstanding": [w.withdrawn(12345, 10, "gone")],
    "string of 257 bytes exceeds the limit of 256": [w.withdrawn(1, 10, "r" * 257)],
    "status code 0 is not an error code": [w.withdrawn(1, 0, "ok?")],
    "status code 17 is not an error code": [w.withdrawn(1, 17, "")],
}


@pytest.mark.parametrize("expected", CASES)
def test_malformed_frame_closes_only_that_connection(backend, server, expected):
    attack(backend, server, CASES[expected], expected)


def test_duplicate_grant_id_is_refused(backend, server):
    def grant_twice(raw):
        if backend == "shm":
            raw.share_region(1, 4096)  # so the grants are otherwise valid
        raw.send(w.grant(5, 0, 1, 1, 0, 10) + w.grant(5, 0, 2, 1, 0, 10))
    attack(backend, server, grant_twice, "granted twice")


def test_garbage_instead_of_a_handshake_is_refused(backend, server):
    _, listener = server
    raw = w.RawPeer(backend, listener.endpoint)
    raw.send(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64)
    raw.receive_until_closed()
    raw.close()
    with raises_exactly(errors.OperationTimeoutError):
        listener.accept(0.2)


def test_peer_that_connects_and_says_nothing_does_not_block_others(backend):
    receiver = transport(backend, "receiver", connect_timeout=1.0)
    listener = receiver.listen(f"{HOST}:0")
    silent = w.RawPeer(backend, listener.endpoint)
    member = transport(backend, "member")
    member.connect(listener.endpoint)
    assert listener.accept(5).peer_name == "member"
    silent.receive_until_closed()  # refused once the handshake deadline passes
    silent.close()


def test_handshake_deadline_covers_the_whole_handshake_not_each_frame(backend):
    """A client that trickles its HELLO a byte at a time must not hold a handshake (a thread and a
    descriptor) past the connect timeout."""
    receiver = transport(backend, "receiver", connect_timeout=1.0)
    listener = receiver.listen(f"{HOST}:0")
    raw = w.RawPeer(backend, listener.endpoint)
    hello = w.frame(w.HELLO, w.greeting(w.PROTOCOL_VERSION, backend, b"\0" * 32, "x" * 200))
    stop = threading.Event()

    def trickle():
        for byte in hello:
            if stop.wait(0.2):
                return
            try:
                raw.send(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=trickle)
    started = time.monotonic()
    sender.start()
    try:
        raw.receive_until_closed()
        assert time.monotonic() - started < 4, "the handshake outlived its 1 s deadline"
    finally:
        stop.set()
        sender.join()
        raw.close()


def test_grants_a_peer_leaves_unused_are_bounded(backend):
    _sender_side, _listener, raw, connection = raw_peer_connected(backend, "sender", max_grants_per_peer=50)
    if backend == "shm":
        raw.share_region(1, 4096)
    raw.send(b"".join(w.grant(i, 0, i, 1, 0, 10) for i in range(1, 51)))
    time.sleep(0.3)
    connection.check()  # 50 unused grants are within the limit
    raw.send(w.grant(51, 0, 51, 1, 0, 10))
    reason = raw.receive_until_closed()
    assert reason is not None and "TF_RDMA_MAX_GRANTS_PER_PEER" in reason
    with raises_exactly(errors.ProtocolError, match=r"more than 50 .*TF_RDMA_MAX_GRANTS_PER_PEER"):
        connection.check()
    raw.close()


def test_concurrent_handshakes_beyond_the_limit_are_refused_at_once(backend):
    """Clients that began a handshake (sent a byte) and stall hold its slots; one more is refused
    at once, not when they give up. (A client that sends nothing holds no slot: see
    test_silent_sockets_do_not_lock_peers_out.)"""
    receiver = transport(backend, "receiver", connect_timeout=30, max_concurrent_handshakes=4)
    listener = receiver.listen(f"{HOST}:0")
    silent = [w.RawPeer(backend, listener.endpoint) for _ in range(2)]
    for peer in silent:
        peer.send(b"\x01")  # the first byte of a HELLO frame, and no more
    time.sleep(0.3)  # both are in their handshakes: the most one source may run (half the limit)
    extra = w.RawPeer(backend, listener.endpoint)
    extra.send(b"\x01")
    started = time.monotonic()
    reason = extra.receive_until_closed()
    assert time.monotonic() - started < 5, "refused only when the silent ones gave up"
    assert reason is not None and "TF_RDMA_MAX_CONCURRENT_HANDSHAKES" in reason, reason
    extra.close()
    for peer in silent:
        peer.close()
    # Their handshakes end with them, and the listener serves members again.
    time.sleep(0.3)
    transport(backend, "member").connect(listener.endpoint)
    assert listener.accept(10).peer_name == "member"


def test_peer_name_that_is_not_utf8_reaches_python_escaped(backend, server):
    _, listener = server
    raw = w.RawPeer(backend, listener.endpoint)
    raw.handshake(KEY, name=b"task-\xff\xfe")
    assert listener.accept(10).peer_name == "task-\\xff\\xfe"
    raw.close()


@pytest.fixture
def raw_listener(backend):
    """Plays a hostile listener where a tf_rdma listener would be: yields its endpoint and
    `serving(play)`, a context in which `play(client_socket)` answers the next client on a thread."""
    import socket
    if backend == "shm":
        import random
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        port = random.randrange(20000, 60000)
        sock.bind(f"\0tf_rdma-shm-{port}")
    else:
        sock = socket.socket()
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    sock.listen(4)
    sock.settimeout(10)

    @contextlib.contextmanager
    def serving(play):
        def serve():
            client, _ = sock.accept()
            with client:
                client.settimeout(10)
                play(client)
                client.recv(4096)  # until the tf_rdma client closed, so it reads all we sent

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            yield
        finally:
            thread.join()

    yield f"{HOST}:{port}", serving
    sock.close()


def test_reject_message_that_is_not_utf8_is_raised_as_the_real_error(backend, raw_listener):
    endpoint, serving = raw_listener

    def refuse(client):
        client.recv(4096)  # the HELLO
        client.sendall(w.reject(9, b"go away \xff\nE0000 forged"))

    with serving(refuse), raises_exactly(errors.HandshakeError,
                                        match=r"go away \\xff\\x0aE0000 forged"):
        transport(backend, "client", connect_timeout=5).connect(endpoint)


def test_an_unauthenticated_name_cannot_forge_log_lines(backend, tmp_path):
    # A listener of its own process: refusals are logged once per 10 s, and this process's
    # listeners may have logged one already.
    with listening_child(tmp_path / "listener.log", (backend,)) as endpoints:
        raw = w.RawPeer(backend, endpoints[backend])
        forged = "E1130 00:00:00.000000 1 fake.cc:1] forged entry"
        raw.send(w.frame(w.HELLO, w.greeting(w.PROTOCOL_VERSION, backend, b"\0" * 32, f"intruder\n{forged}")))
        raw.receive()  # the listener's answer; then a proof that is wrong
        raw.send(w.frame(w.PROOF, b"\0" * 32))
        raw.receive_until_closed()
        raw.close()
    logged = (tmp_path / "listener.log").read_text()
    assert "intruder\\x0aE1130" in logged, logged
    assert not any(line.startswith(forged) for line in logged.splitlines())


# ---- Properties of the decoder itself ----

@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_never_crashes_on_arbitrary_bytes(data):
    try:
        _testing.decode_frame(data)
    except errors.ProtocolError:
        pass


def valid_frames():
    u64 = st.integers(0, 2**64 - 1)
    return st.one_of(
        st.builds(lambda *a: w.grant(*a), u64, u64, u64, st.integers(0, 2**32 - 1), u64, u64),
        st.builds(lambda g, n: w.data(g, n), u64, u64),
        st.builds(lambda g, n: w.too_small(g, n), u64, u64),
        st.builds(lambda n, name: w.frame(w.HELLO, w.greeting(1, "tcp", n, name)),
                  st.binary(min_size=32, max_size=32), st.text(max_size=40)),
        st.just(w.frame(w.PING)),
    )


@settings(max_examples=1000, deadline=None)
@given(valid_frames(), st.data())
def test_valid_frames_decode_and_any_corruption_is_caught_or_harmless(encoded, data):
    assert _testing.decode_frame(encoded)
    position = data.draw(st.integers(0, len(encoded) - 1))
    corrupted = bytearray(encoded)
    corrupted[position] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(corrupted)))
    for candidate in (bytes(corrupted), bytes(corrupted[:cut])):
        try:
            _testing.decode_frame(candidate)
        except errors.ProtocolError:
            pass


# ---- Who proves first ----

def test_a_listener_proves_nothing_to_a_client_that_has_not(backend, server):
    """Whatever a listener sends before the client proved the key must not depend on the key, or
    one unauthenticated exchange would let anyone test guesses of TF_RDMA_SECRET offline."""
    _, listener = server
    raw = w.RawPeer(backend, listener.endpoint)
    nonce = os.urandom(32)
    raw.send(w.frame(w.HELLO, w.greeting(w.PROTOCOL_VERSION, backend, nonce, "guesser")))
    kind, challenge = raw.receive()
    assert kind == w.CHALLENGE
    server_nonce = challenge[5:37]
    for direction in ("initiator->responder", "responder->initiator"):
        assert w.token(KEY, direction, backend, "guesser", "receiver", nonce, server_nonce) not in challenge
    # Nothing but version, backend, nonce, then the listener's name and build as strings.
    name_length = int.from_bytes(challenge[37:39], "little")
    assert challenge[39:39 + name_length] == b"receiver"
    build_length = int.from_bytes(challenge[39 + name_length:41 + name_length], "little")
    assert len(challenge) == 41 + name_length + build_length
    raw.send(w.frame(w.PROOF, b"\0" * 32))  # a guess
    reason = raw.receive_until_closed()
    assert reason is not None and "cluster key mismatch" in reason
    raw.close()


def test_a_client_does_not_trust_a_listener_that_cannot_prove_the_key(backend, raw_listener):
    """The listener proves the key in its ACCEPT, after the client did: a listener that accepts
    any proof without holding the key is refused."""
    endpoint, serving = raw_listener

    def accept_anything(client):
        client.recv(4096)  # HELLO
        client.sendall(w.frame(w.CHALLENGE, w.greeting(w.PROTOCOL_VERSION, backend, os.urandom(32),
                                                      "impostor")))
        client.recv(4096)  # PROOF
        client.sendall(w.frame(w.ACCEPT, b"\0" * 32))

    with serving(accept_anything), raises_exactly(errors.HandshakeError,
                                                 match="cluster key mismatch with impostor"):
        transport(backend, "client", connect_timeout=5).connect(endpoint)
