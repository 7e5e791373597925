"""The adversarial suite (issue 9): a hostile peer written from the wire format (hostile_peer.py)
attacks a tf_rdma listener running in a child process (victim_process.py) with seeded, bounded
fuzz campaigns. After every batch: the victim is alive, no byte outside the granted ranges changed
(in its regions, and on shm in the regions it writes into), the guilty connection failed with a
ProtocolError naming the cause the protocol predicts, its descriptors and threads are gone, and a
legitimate peer still moves data byte-exactly through the same listener.

FUZZ_SEED and FUZZ_FRAMES choose the campaign; a failure names the seed and batch,
and FUZZ_BATCH=N replays that batch alone."""
import contextlib
import gc
import hashlib
import os
import re
import socket
import struct
import threading
import time
from collections import Counter

import pytest

from tests.transport import hostile_peer
from tests.transport import wire_client as w
from tests.transport.helpers import HOST, KEY, listening_child, raises_exactly, transport
from tf_rdma import _transport, errors
from tf_rdma.config import load_config
from tests.transport.victim_process import GRANTS, WRITES, VictimProcess

pytestmark = pytest.mark.stream_backends_only

SEED = int(os.environ.get("FUZZ_SEED", "9"))
FRAMES = int(os.environ.get("FUZZ_FRAMES", "2000"))
HANDSHAKE_FRAMES = int(os.environ.get("FUZZ_HANDSHAKE_FRAMES", "200"))
ONLY_BATCH = os.environ.get("FUZZ_BATCH")


@pytest.fixture
def victim(backend):
    victim = VictimProcess(backend)
    member = transport(backend, "member")
    ok, answer = victim.legit_peer_moves_data(member, 0)
    assert ok, answer
    # Whatever the first connection set up for good is part of the level to come back to.
    victim.ask("baseline")
    victim.member = member
    yield victim
    victim.assert_alive()
    victim.stop()


def failure_of(*connections, timeout=10):
    """The error the first of `connections` to fail fails with, once a peer of theirs is gone; fails
    the test if all are still up after `timeout` s, instead of waiting for ever."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for connection in connections:
            try:
                connection.check()
            except errors.TransportError as error:
                return error
        time.sleep(0.01)
    names = ", ".join(sorted({c.peer_name for c in connections}))
    pytest.fail(f"the connection with {names} was still up {timeout} s after its peer left")


def check_leftovers(verdict, context):
    assert verdict["extra_descriptors"] == 0, f"{context}: descriptors left open: {verdict['descriptors']}"
    assert verdict["extra_threads"] == 0, f"{context}: {verdict['extra_threads']} threads left running"


def check_batch(batch, expected, verdict, problems, context):
    # Memory first: a write out of bounds is the worst outcome, whatever else went wrong.
    assert not verdict["changed_outside_grants"], \
        f"{context}: the victim's region changed outside its grants at {verdict['changed_outside_grants']}"
    assert not verdict["bystander_changed"], \
        f"{context}: memory granted to no peer changed at {verdict['bystander_changed']}"
    assert verdict["region_sha256"] == hashlib.sha256(batch.model.victim_region).hexdigest(), \
        f"{context}: the victim's granted ranges do not hold exactly what the hostile peer wrote"
    assert not problems, f"{context}: {problems}"
    error = verdict["error"] or ""
    if expected == "REJECT":
        # The peer ended the connection itself: its REJECT's reason is what the victim reports.
        assert "closed the connection" in error, f"{context}: {verdict}"
    else:
        assert verdict["error_class"] == "ProtocolError", f"{context}: expected /{expected}/, got {verdict}"
        assert "broke the tf_rdma protocol" in error and re.search(expected, error), \
            f"{context}: expected /{expected}/, got {error!r}"
    model = batch.model
    outstanding_tags = {grant[0] for grant in model.victim_grants.values()}
    for (tag, _, _), (outcome, detail) in zip(GRANTS, verdict["grants"]):
        if tag in outstanding_tags:
            # Never answered: it fails with the connection's error, and nothing else happened to it.
            assert outcome == verdict["error_class"] and detail == error, f"{context}: grant {tag}: {outcome} {detail}"
        else:
            # Filled, returned TOO_SMALL, or withdrawn (WITHDRAWN).
            assert outcome in ("ok", "MessageTooLargeError", "AbortedError"), f"{context}: grant {tag}: {outcome} {detail}"
    for (tag, _), (outcome, detail) in zip(WRITES, verdict["writes"]):
        if tag in model.waiting:
            assert outcome == verdict["error_class"], f"{context}: write {tag}: {outcome} {detail}"
        else:
            # Paired (it may have been cut off by the connection's end) or discarded.
            assert outcome in ("ok", "CancelledError", verdict["error_class"]), f"{context}: write {tag}: {outcome} {detail}"
    check_leftovers(verdict, context)


def test_fuzzed_frames_after_a_valid_handshake(backend, victim):
    """At least FRAMES fuzzed frames of every type, in batches of one connection each."""
    frames, batches, kinds, causes = 0, 0, Counter(), Counter()
    started = time.monotonic()
    batch_numbers = [int(ONLY_BATCH)] if ONLY_BATCH else range(10**6)
    for number in batch_numbers:
        if frames >= FRAMES and not ONLY_BATCH:
            break
        context = (f"{backend} batch {number}; replay with FUZZ_SEED={SEED} "
                   f"FUZZ_BATCH={number}")
        fuzzer = hostile_peer.Fuzzer(f"{SEED}/{backend}/{number}")
        batch = hostile_peer.Batch(backend, victim.endpoint, KEY, fuzzer)
        victim.ask("attack")
        batch.wait_for_victim_grants()
        expected = batch.run(max_frames=fuzzer.random.randrange(1, 40))
        problems = batch.finish()
        verdict = victim.ask("verdict")
        context += f"; frames sent: {batch.sent}"
        check_batch(batch, expected, verdict, problems, context)
        ok, answer = victim.legit_peer_moves_data(victim.member, number + 1)
        assert ok, f"{context}: the legitimate peer after it: {answer}"
        frames += len(batch.sent)
        batches += 1
        kinds.update(name.removeprefix("terminal ") for name in batch.sent)
        cause = verdict["error"].split("protocol: ")[-1] if expected != "REJECT" else "the peer's REJECT"
        causes[re.sub(r"\d+", "N", cause.removesuffix("; connection closed."))] += 1
    print(f"\n{backend}: {frames} fuzzed frames in {batches} batches in {time.monotonic() - started:.1f} s "
          f"(seed {SEED}); by type: {dict(kinds)}")
    for cause, count in causes.most_common():
        print(f"  {count:4} {cause}")
    assert ONLY_BATCH or set(hostile_peer.NAMES.values()) <= set(kinds), kinds


def test_fuzzed_handshakes(backend, victim):
    """Garbage, mutated HELLOs, wrong and malformed PROOFs, frames out of turn: none yields a
    connection, and each leaves nothing behind."""
    frames, cases = 0, 0
    while frames < HANDSHAKE_FRAMES:
        context = f"{backend} handshake case {cases}; replay with FUZZ_SEED={SEED}"
        fuzzer = hostile_peer.Fuzzer(f"{SEED}/{backend}/handshake/{cases}")
        sent, reason = hostile_peer.handshake_attack(backend, victim.endpoint, KEY, fuzzer)
        if reason is not None:
            assert reason.isprintable(), f"{context}: {reason!r}"
        verdict = victim.ask("nothing")
        assert verdict["accepted"] is None, f"{context}: a connection was accepted: {verdict}"
        check_leftovers(verdict, context)
        frames += sent
        cases += 1
    ok, answer = victim.legit_peer_moves_data(victim.member, 1)
    assert ok, answer
    print(f"\n{backend}: {frames} fuzzed handshake frames in {cases} connections (seed {SEED})")


def test_stalls_and_floods(backend, victim):
    """A peer that stops mid-frame is dropped as unresponsive once the peer timeout passes; one
    that floods PINGs costs nothing and keeps its connection; neither disturbs anyone else."""
    flood = hostile_peer.Batch(backend, victim.endpoint, KEY, hostile_peer.Fuzzer(SEED))
    victim.ask("attack")
    flood.wait_for_victim_grants()
    flood.send(w.frame(w.PING) * 20000 + w.frame(99))
    assert not flood.finish()
    verdict = victim.ask("verdict")
    assert verdict["error_class"] == "ProtocolError" and "unknown frame type 99" in verdict["error"], verdict
    check_leftovers(verdict, "after a PING flood")

    stalled = hostile_peer.Batch(backend, victim.endpoint, KEY, hostile_peer.Fuzzer(SEED))
    victim.ask("attack")
    stalled.wait_for_victim_grants()
    stalled.send(w.data(1, 10)[:11])  # a header and part of a body, then nothing
    ok, answer = victim.legit_peer_moves_data(victim.member, 3)  # meanwhile, others are served
    assert ok, answer
    verdict = victim.ask("verdict")  # the victim's peer timeout is 5 s
    assert verdict["error_class"] == "PeerUnavailableError" and "is unresponsive" in verdict["error"], verdict
    stalled.finish()
    check_leftovers(verdict, "after a stalled peer")


# ---- Reflection (issue 22): a squatter without the key, at an address the victim dials ----

@pytest.mark.parametrize("rewrite", ["as it is", "renamed"])
def test_a_squatter_relaying_to_the_victims_own_listener_gets_no_connection(backend, victim, rewrite):
    """The squatter relays the victim's handshake to the victim's own listener and the answers
    back, as they are or claiming other names, so that the victim would prove the key to itself:
    both ends refuse (a peer with the process's own name, or sending back its nonce), the victim's
    listener accepts nobody, and the victim's dial fails naming the cause."""
    squatter = hostile_peer.Squatter(
        backend, victim.endpoint,
        (lambda kind, body: body) if rewrite == "as it is" else hostile_peer.renamed("/job:ps/replica:0/task:0"))
    answer = victim.ask(f"dial {squatter.endpoint}")
    squatter.close()
    assert "connected" not in answer, f"the victim connected to itself through the squatter: {answer}"
    assert answer["failed"].startswith("HandshakeError") and "refused a reflected handshake" in answer["failed"], answer
    verdict = victim.ask("nothing")
    assert verdict["accepted"] is None, f"the victim's listener accepted the relayed handshake: {verdict}"
    check_leftovers(verdict, f"after a relayed handshake ({rewrite})")
    relayed = [(direction, kind) for direction, kind, _ in squatter.frames]
    assert ("to listener", w.PROOF) not in relayed, relayed
    ok, answer = victim.legit_peer_moves_data(victim.member, 11)
    assert ok, answer


def test_a_squatter_sending_the_victims_nonce_back_gets_no_proof(backend, victim):
    """The initiator's token reaches whoever it dials; one that answers with the initiator's own
    nonce (to collect a token it could replay or reflect) is refused before any token is sent."""
    listening, endpoint = hostile_peer.squat(backend)
    received = []
    closed_by_victim = threading.Event()

    def echo(peer):
        _, hello = peer.receive()
        version, _, nonce, _, _ = w.parse_greeting(hello)
        peer.send(w.frame(w.CHALLENGE, w.greeting(version, backend, nonce, "/job:ps/replica:0/task:0")))
        try:
            while True:
                received.append(peer.receive()[0])
        except (EOFError, ConnectionResetError):
            closed_by_victim.set()  # not a timeout of the peer's socket

    with hostile_peer.answering_each(backend, listening, echo):
        answer = victim.ask(f"dial {endpoint}")
        assert closed_by_victim.wait(15), "the victim kept the connection to the squatter open"
    assert "connected" not in answer and "sent back a nonce this process issued" in answer["failed"], answer
    assert w.PROOF not in received, f"the victim sent its token to a peer that echoed its nonce: {received}"
    check_leftovers(victim.ask("nothing"), "after an echoed nonce")


# ---- What refused handshakes cost the listener's log ----

def wrong_key_handshake(backend, endpoint):
    """A HELLO, then a PROOF made with another key: the listener's REJECT reason."""
    peer = w.RawPeer(backend, endpoint)
    nonce = os.urandom(32)
    peer.send(w.frame(w.HELLO, w.greeting(w.PROTOCOL_VERSION, backend, nonce, "intruder")))
    kind, body = peer.receive()
    assert kind == w.CHALLENGE, (kind, body)
    _, _, listener_nonce, listener_name, _ = w.parse_greeting(body)
    peer.send(w.frame(w.PROOF, w.token(b"not the cluster key", "initiator->responder", backend, "intruder",
                                       listener_name, nonce, listener_nonce)))
    reason = peer.receive_until_closed()
    peer.close()
    return reason


def test_refused_handshakes_are_logged_once_per_ten_seconds_with_the_count_left_out(tmp_path):
    """300 wrong-key handshakes in a burst (over tcp and shm, whose listeners log refusals with one
    statement) write one WARNING, not 300; the next refusal ten seconds on is logged with how many
    went unlogged in between, as accept errors are limited."""
    with listening_child(tmp_path / "listener.log") as endpoints:
        started = time.monotonic()
        for i in range(300):
            backend = ("tcp", "shm")[i % 2]
            assert "cluster key mismatch with intruder" in wrong_key_handshake(backend, endpoints[backend])
        burst = time.monotonic() - started
        # Within one 10 s window, or the count below would mean nothing (a sanitized build is slower).
        assert burst < 9, f"the 300 refusals took {burst:.1f} s"
        time.sleep(10.5 - burst)
        wrong_key_handshake("tcp", endpoints["tcp"])
    log = (tmp_path / "listener.log").read_text()
    refused = [line for line in log.splitlines() if "tf_rdma: refused a" in line]
    assert len(refused) == 2, f"{len(refused)} lines for 301 refusals in {burst:.1f} s + 1: {refused[:3]}"
    assert "cluster key mismatch with intruder" in refused[0] and "not logged" not in refused[0], refused
    assert refused[1].endswith("(299 more since the last such line, not logged)"), refused


# ---- What a squatter's REJECT does to a dial (no REJECT is authenticated) ----

UNAVAILABLE, RESOURCE_EXHAUSTED = 14, 8


# A refusal for good is a failed handshake; one retried until the connect timeout, an unreachable peer.
@pytest.mark.parametrize("in_place_of, code, retried, raised_class", [
    ("CHALLENGE", UNAVAILABLE, False, errors.HandshakeError),       # "not now" is no answer to a HELLO
    ("ACCEPT", UNAVAILABLE, True, errors.PeerUnavailableError),     # where a listener's admission says "not now"
    ("CHALLENGE", RESOURCE_EXHAUSTED, True, errors.PeerUnavailableError),  # a listener short of handshake slots: "busy"
    ("ACCEPT", RESOURCE_EXHAUSTED, False, errors.HandshakeError),   # "busy" once the handshake ran
])
def test_a_squatters_reject_is_quoted_as_unauthenticated_and_retried_only_where_a_listener_asks(
        backend, in_place_of, code, retried, raised_class):
    """A squatter without the key answers every dial with a REJECT of its own words, in place of
    the CHALLENGE or of the ACCEPT. The dialler quotes them as the unauthenticated words of whoever
    answered, and tries again only where a legitimate listener refuses for now; any other REJECT
    fails the dial at once, as hanging up does."""
    connect_timeout = 2.0
    dialler = transport(backend, "victim", connect_timeout=connect_timeout)
    listening, endpoint = hostile_peer.squat(backend)
    words = "tf_rdma is down for maintenance; set TF_RDMA_SECRET=letmein and retry"
    answered = []

    def refuse(peer):
        peer.receive()  # the HELLO
        if in_place_of == "ACCEPT":
            peer.send(w.frame(w.CHALLENGE, w.greeting(w.PROTOCOL_VERSION, backend, os.urandom(32),
                                                      "/job:ps/replica:0/task:0")))
            peer.receive()  # the PROOF
        peer.send(w.reject(code, words))
        answered.append(in_place_of)
        peer.receive_until_closed()

    with hostile_peer.answering_each(backend, listening, refuse):
        started = time.monotonic()
        with raises_exactly(raised_class) as refused:
            dialler.connect(endpoint)
        took = time.monotonic() - started
    assert f"the peer at {endpoint}, not authenticated, said: {words}" in str(refused.value), refused.value
    if retried:
        assert len(answered) >= 2 and took >= connect_timeout - 0.1, (answered, took)
        assert f"within {connect_timeout:.0f}s (TF_RDMA_CONNECT_TIMEOUT_MS)" in str(refused.value), refused.value
    else:
        assert answered == [in_place_of] and took < connect_timeout / 2, (answered, took)


# ---- Offline guessing (issue 22): whoever a task dials sees its token ----

WORDS = ["trustno1", "password", "letmein", "hunter2", "correct horse battery staple", "tf_rdma", "secret",
         "tensorflow", "correcthorsebatterystaple"]
# Common passwords and each of them repeated: length alone makes no secret.
GUESSES = [word * times for word in WORDS for times in range(1, 9)]


def test_offline_guessing_from_a_dialling_victims_token_finds_a_weak_secret_so_tasks_refuse_them(backend):
    """A squatter answering the victim's dial receives its PROOF, a function of public values and
    the key, on which guesses of the secret can be tested offline: with a weak secret (the cluster
    key derived from it directly, as a task without the strength check would) a list of common
    passwords and their repetitions finds it ('password' x 6 among them, which a rule estimating
    length x Shannon entropy accepted). Every secret on such a list is therefore refused when a
    task loads it."""
    for guess in GUESSES:
        with raises_exactly(errors.ConfigError, match="TF_RDMA_SECRET is too weak"):
            load_config({"TF_RDMA_SECRET": guess})

    weak = "password" * 6
    victim = transport(backend, "victim", key=_transport.cluster_key(weak.encode()), connect_timeout=1)
    listening, endpoint = hostile_peer.squat(backend)

    def dial():
        with contextlib.suppress(errors.TransportError):  # no ACCEPT comes
            victim.connect(endpoint)
    dial = threading.Thread(target=dial, daemon=True)
    dial.start()
    raw = w.RawPeer.accepted(backend, listening.accept()[0])  # squat's listener times out
    kind, hello = raw.receive()
    _, _, victim_nonce, victim_name, _ = w.parse_greeting(hello)
    our_nonce = os.urandom(32)
    raw.send(w.frame(w.CHALLENGE, w.greeting(w.PROTOCOL_VERSION, backend, our_nonce, "ps")))
    kind, proof = raw.receive()
    assert kind == w.PROOF
    raw.close()
    dial.join(10)
    listening.close()
    assert not dial.is_alive(), "the victim's dial outlived its 1 s connect timeout"

    def guessed(candidate):
        return proof == w.token(_transport.cluster_key(candidate.encode()), "initiator->responder", backend,
                                victim_name, "ps", victim_nonce, our_nonce)
    assert [guess for guess in GUESSES if guessed(guess)] == [weak]


# ---- What a key holder's many connections may take (issue 22) ----

def test_connections_claiming_one_task_name_are_bounded(backend):
    """A key holder opening connection after connection under one name is refused past
    TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME, told why; other names, and the name once one of its
    connections closed, are served."""
    local = transport(backend, "victim", max_connections_per_peer_name=2)
    listener = local.listen(f"{HOST}:0")
    peers = [w.RawPeer(backend, listener.endpoint) for _ in range(3)]
    # Each connection accepted before the next handshake: handshakes run on several threads, and
    # the order they reach the limit on the listener's side is not the order their peers ended
    # them (a loaded host can start the third before the first).
    accepted = []
    for peer in peers[:2]:
        peer.handshake(KEY, name="greedy")
        accepted.append(listener.accept(10))
    peers[2].handshake(KEY, name="greedy")
    reason = peers[2].receive_until_closed()
    assert reason and "TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME" in reason and "greedy" in reason, reason
    other = w.RawPeer(backend, listener.endpoint)
    other.handshake(KEY, name="modest")
    assert listener.accept(10).peer_name == "modest"
    peers[0].close()
    failure_of(accepted[0])
    again = w.RawPeer(backend, listener.endpoint)
    again.handshake(KEY, name="greedy")
    assert listener.accept(10).peer_name == "greedy"
    for peer in (*peers[1:], other, again):
        peer.close()


def test_shm_bytes_mapped_for_all_peers_together_are_bounded():
    """shm only: Peers each within TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER cannot together map more than
    TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL: the region past it closes its connection naming the
    variable, and the bytes of a connection that ended count no more."""
    backend = "shm"
    local = transport(backend, "victim", shm_max_mapped_bytes_total=3 << 20)
    listener = local.listen(f"{HOST}:0")

    def sharing(name, size):
        peer = w.RawPeer(backend, listener.endpoint)
        peer.handshake(KEY, name=name)
        connection = listener.accept(10)
        peer.share_region(1, size)
        return peer, connection

    first, first_connection = sharing("first", 2 << 20)
    first.send(w.frame(w.PING))
    time.sleep(0.2)
    first_connection.check()  # within the total
    second, second_connection = sharing("second", 2 << 20)
    reason = second.receive_until_closed()
    assert reason and "TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL" in reason, reason
    with raises_exactly(errors.ResourceLimitError, match="TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL"):
        second_connection.check()
    first.close()
    failure_of(first_connection)
    del first_connection
    gc.collect()
    third, third_connection = sharing("third", 2 << 20)
    third.send(w.frame(w.PING))
    time.sleep(0.2)
    third_connection.check()  # the first's bytes were given back
    third.close()


def test_connections_under_one_name_together_map_no_more_than_one_peer_may():
    """shm only: a key holder opening connections under one name, each sharing a region of
    TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER, has the second refused naming the variable and the
    name (each connection used to have the limit to itself, so that enough of them took all of
    TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL); another name's region is still mapped, and its
    connection moves data."""
    backend = "shm"
    local = transport(backend, "victim", shm_max_mapped_bytes_per_peer=1 << 20,
                      shm_max_mapped_bytes_total=4 << 20)
    listener = local.listen(f"{HOST}:0")

    def sharing(name):
        """A connection under `name` sharing region 1 of 1 MiB: (peer, connection, the region's descriptor)."""
        peer = w.RawPeer(backend, listener.endpoint)
        peer.handshake(KEY, name=name)
        connection = listener.accept(10)
        fd = hostile_peer.memfd(1 << 20)
        peer.sock.sendmsg([w.frame(w.SHM_REGION, struct.pack("<IQ", 1, 1 << 20))],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("<i", fd))])
        try:
            peer.send(w.frame(w.PING))
        except (BrokenPipeError, ConnectionResetError):
            # A refused region's connection may be closed already (EPIPE; ECONNRESET where the
            # victim closed with our bytes unread); its REJECT stays readable.
            pass
        return peer, connection, fd

    def refused(connection):
        try:
            connection.check()
            return False
        except errors.ResourceLimitError:
            return True

    greedy = [sharing("greedy") for _ in range(4)]
    # The name's first megabyte is whichever connection's region the victim took first (the four
    # may be served by different I/O threads, in either order); each other one is refused.
    deadline = time.monotonic() + 10
    while len([g for g in greedy if refused(g[1])]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    mapped = [g for g in greedy if not refused(g[1])]
    assert len(mapped) == 1, f"{len(mapped)} of 4 connections under one name have their region mapped"
    mapped[0][1].check()
    for peer, connection, _ in (g for g in greedy if g is not mapped[0]):
        reason = peer.receive_until_closed()
        assert reason and "TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER" in reason and "greedy" in reason, reason
        with raises_exactly(errors.ResourceLimitError, match="peers named greedy"):
            connection.check()
    modest, modest_connection, modest_fd = sharing("modest")
    time.sleep(0.2)
    modest_connection.check()
    # Its region is mapped: what is written into a grant in it lands there.
    payload = os.urandom(1000)
    modest.send(w.grant(1, 0, 5, 1, 4096, len(payload)))
    modest_connection.write(5, payload).wait(10)
    assert modest.receive() == (w.DATA, struct.pack("<QQ", 1, len(payload)))
    assert os.pread(modest_fd, len(payload), 4096) == payload
    for peer, _, fd in (*greedy, (modest, None, modest_fd)):
        peer.close()
        os.close(fd)


# ---- What a key holder can make a shm sender do (issue 36) ----

def test_a_region_shared_again_smaller_under_a_granted_id_cannot_crash_the_sender():
    """shm only: a key holder acting as receiver grants the last 64 KiB of a 1 MiB region, says the
    region is gone, shares the same id again as 4 KiB; the sender's write into the old grant then
    fails its connection naming the region (it used to copy past the new 4 KiB mapping: SIGSEGV)."""
    backend = "shm"
    victim = VictimProcess(backend)
    try:
        peer = victim.holding_raw_peer(KEY, "reuser")
        peer.share_region(1, 1 << 20)
        peer.send(w.grant(1, 0, 100, 1, (1 << 20) - (64 << 10), 64 << 10))
        peer.region_gone(1)
        peer.share_region(1, 4 << 10)
        # Read by the victim's I/O thread within microseconds; the write must come after all four.
        time.sleep(1)
        answer = victim.ask(f"write 100 {64 << 10}")
        victim.assert_alive()
        kind, message = answer["write"]
        assert kind == "ProtocolError", answer
        assert "broke the tf_rdma protocol" in message and "region 1" in message, answer
        assert "shared again as 4096 bytes" in message, answer
        peer.close()
    finally:
        victim.assert_alive()
        victim.stop()
