"""A listener under exhausted resources, for real, in a child process with lowered limits: it must
back off and keep serving, never end its accept loop or abort the process."""
import collections
import contextlib
import os
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.transport import hostile_peer
from tests.transport import wire_client as w
from tests.transport.helpers import HOST, KEY, free_port, next_line, pattern, transport
from tests.transport.victim_process import VictimProcess
from tf_rdma import errors

pytestmark = pytest.mark.stream_backends_only

def listener_in_child(backend, limit_setup, connect_timeout):
    """A tf_rdma listener in a child process whose limits `limit_setup` (Python code) lowered. It
    prints its endpoint once they are lowered, then the name of every peer it accepts, until stdin
    closes. Its accepting thread starts before: under the lowered limits that thread could fail to
    start itself, which is not what the tests are about."""
    script = textwrap.dedent(f'''
        import resource, sys, threading
        from tests.transport.helpers import HOST, transport
        receiver = transport({backend!r}, "receiver", connect_timeout={connect_timeout})
        listener = receiver.listen(f"{{HOST}}:0")
        def accept_all():
            while True:
                try:
                    print("accepted", listener.accept(3600).peer_name, flush=True)
                except Exception as e:
                    print("accept failed", e, flush=True)
                    return
        threading.Thread(target=accept_all, daemon=True).start()
    ''') + textwrap.dedent(limit_setup) + textwrap.dedent('''
        print(listener.endpoint, flush=True)
        sys.stdin.read()
    ''')
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # What it logs, read as it comes: a refused client logs a warning each, which must neither
    # fill the pipe (the child would block in its logging) nor wait to be seen until the end.
    child.logged = []
    threading.Thread(target=lambda: child.logged.extend(child.stderr), daemon=True).start()
    return child


def logged(child):
    return "".join(list(child.logged))


def member_connects(backend, child, attempts=3):
    """Whether a legitimate peer still gets through to the child's listener. Resources come back
    as the refused clients' handshakes wind down, so it may take a few tries on a loaded host."""
    for attempt in range(attempts):
        try:
            to_child = transport(backend, "member", connect_timeout=5).connect(child.endpoint)
        except errors.TransportError as error:
            print(f"attempt {attempt}: {error}")
            time.sleep(1)
            continue
        line = next_line(child)
        to_child.close()
        return line == "accepted member"
    return False


def run_exhaustion(backend, limit_setup, connections, limit_hit, connect_timeout=2):
    """Stalled clients run the child's listener into its limit; they stay connected until it logged
    `limit_hit` (within 20 s, or the test fails), then leave, and a member must get through."""
    child = listener_in_child(backend, limit_setup, connect_timeout)
    try:
        child.endpoint = next_line(child)
        # Clients that send one byte and stall: a client gets a handshake thread once it sent its
        # first byte (a silent one only waits, holding a descriptor, and only while silent ones
        # hold less than half of what the process has spare), so these exhaust the threads.
        stalled = []
        for _ in range(connections):
            stalled.append(w.RawPeer(backend, child.endpoint))
            stalled[-1].sock.sendall(b"\x01")
        deadline = time.monotonic() + 20
        while limit_hit not in logged(child) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None, f"the listener's process died: {logged(child)}"
        assert limit_hit in logged(child), f"the listener never ran into its limit: {logged(child)}"
        for peer in stalled:
            peer.close()
        time.sleep(0.5)  # their handshakes end
        assert member_connects(backend, child), "the listener stopped serving"
        assert child.poll() is None
    finally:
        child.stdin.close()
        child.wait(10)


def test_running_out_of_descriptors_does_not_end_the_accept_loop(backend):
    # Room for a few handshakes above what is open now; the silent clients exhaust it.
    run_exhaustion(backend, '''
        import os
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    ''', connections=20, limit_hit="Too many open files")


def test_failing_to_start_a_handshake_thread_refuses_that_client_only(backend):
    # Address space for a few thread stacks more than the process has now: thread creation fails.
    run_exhaustion(backend, '''
        def mapped_bytes():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + (40 << 20), resource.RLIM_INFINITY))
    ''', connections=20, limit_hit="cannot start a thread")


def test_a_pids_limit_refuses_the_clients_it_cannot_serve_not_the_process(backend):
    """RLIMIT_NPROC (what a container's pids limit amounts to) counts every thread of the user, and
    does not bind root: the child becomes a user with no other process, allowed a few threads more
    than it runs, so that silent clients exhaust them."""
    if os.geteuid() != 0:
        pytest.skip("needs root: RLIMIT_NPROC is only exact for a user running nothing else, and "
                    "switching to one takes root")
    run_exhaustion(backend, '''
        import os
        os.setgid(54321)
        os.setuid(54321)
        threads = len(os.listdir("/proc/self/task"))
        resource.setrlimit(resource.RLIMIT_NPROC, (threads + 4, threads + 4))
    ''', connections=20, limit_hit="cannot start a thread")

# Room for the listener's own threads and a legitimate peer's connection, not for a hostile
# peer's flood: what the flood needs then fails to be allocated.
ADDRESS_SPACE_HEADROOM = '''
import resource
def mapped_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + (64 << 20), resource.RLIM_INFINITY))
'''


def test_a_peer_exhausting_the_address_space_fails_its_connection_only(backend, monkeypatch):
    """Under RLIMIT_AS, a peer's flood (tcp: GRANTs under distinct tags, within
    TF_RDMA_MAX_GRANTS_PER_PEER; shm: sparse regions of 256 MiB, within
    TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER) runs the listener's process out of memory: that
    connection fails with a ResourceLimitError saying so, the process lives on, leaves nothing
    behind, and serves a legitimate peer."""
    # A thread's first allocation may reserve a malloc arena of its own (64 MiB, all the
    # headroom), which would decide at random whether a legitimate handshake's thread fits: every
    # thread shares one arena (mallopt M_ARENA_MAX = -8). tcp's flood then grows that arena, whose
    # free space from before the limit is unknown: the peer may keep 16 times the default number
    # of grants outstanding, far more than any such slack holds.
    monkeypatch.setenv("TF_RDMA_MAX_GRANTS_PER_PEER", str(1 << 20))
    one_arena = "import ctypes\nctypes.CDLL(None).mallopt(-8, 1)\n"
    victim = VictimProcess(backend, limit_setup=one_arena + ADDRESS_SPACE_HEADROOM)
    member = transport(backend, "member")
    try:
        assert victim.legit_peer_moves_data(member, 1)[0]
        victim.ask("baseline")
        flood = hostile_peer.Batch(backend, victim.endpoint, KEY, hostile_peer.Fuzzer(0))
        victim.ask("attack")
        flood.wait_for_victim_grants()
        if backend == "shm":
            try:
                for region_id in range(2, 66):
                    flood.send(w.frame(w.SHM_REGION, struct.pack("<IQ", region_id, 256 << 20)),
                               [hostile_peer.memfd(256 << 20)])
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused mid-flood, as it should be
        else:
            assert not flood.flood(b"".join(w.grant(i, 1, i, 1, 0, 10) for i in range(first, first + 1024))
                                   for first in range(1, 1 << 20, 1024)), "the flood was taken whole"
        assert not flood.finish()
        verdict = victim.ask("verdict")
        assert verdict["error_class"] == "ResourceLimitError", verdict["error"]
        assert re.search("out of memory|cannot map the peer's region", verdict["error"]), verdict["error"]
        assert verdict["extra_descriptors"] == 0 and verdict["extra_threads"] == 0, verdict
        ok, answer = victim.legit_peer_moves_data(member, 2)
        assert ok, answer
    finally:
        victim.assert_alive()
        victim.stop()


# ---- Descriptors: what silent sockets may hold, and what running out of them is called ----

COMMON_DESCRIPTOR_LIMIT = 1024  # RLIMIT_NOFILE's soft default on most Linux distributions
LOWER_DESCRIPTOR_LIMIT = f'''
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, ({COMMON_DESCRIPTOR_LIMIT}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
'''


@contextlib.contextmanager
def silent_flood(backend, endpoint, per_second):
    """An outsider opening `per_second` sockets a second to `endpoint` that never send a byte, each
    closed 3 s after it opened (the listener drops a silent client after 2 s), for as long as the
    context lasts; yields a function that fails the test unless the flood runs at its full rate
    (holding ~3 x per_second descriptors: this process's soft RLIMIT_NOFILE is raised for it, or at
    a common 1024 the flood itself would die of EMFILE and the test pass with no flood)."""
    host, port = endpoint.rsplit(":", 1)
    family, address = ((socket.AF_UNIX, f"\0tf_rdma-shm-{port}") if backend == "shm"
                       else (socket.AF_INET, (host, int(port))))
    stop = threading.Event()

    def flood():
        held = collections.deque()
        started = time.monotonic()
        try:
            while not stop.is_set():
                now = time.monotonic()
                while held and now - held[0][0] > 3:
                    held.popleft()[1].close()
                while thread.opened < (now - started) * per_second:
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    sock.connect_ex(address)  # in progress (tcp), or refused with a full backlog: either counts
                    held.append((now, sock))
                    thread.opened += 1
                time.sleep(0.005)
        except OSError as error:
            thread.error = error
        finally:
            for _, sock in held:
                sock.close()

    def at_full_rate():
        assert thread.is_alive() and thread.error is None, f"the flood stopped: {thread.error}"
        assert thread.opened >= 2.5 * per_second, f"the flood opened only {thread.opened} sockets"

    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8 * per_second)), hard))
    thread = threading.Thread(target=flood, daemon=True)
    thread.opened, thread.error = 0, None
    thread.start()
    try:
        time.sleep(3)  # the flood's first sockets are dropped: it comes and goes at its full rate
        at_full_rate()
        yield at_full_rate
    finally:
        stop.set()
        thread.join(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_silent_sockets_leave_a_process_at_its_descriptor_limit_room_for_peers(backend):
    """The victim runs at RLIMIT_NOFILE=1024 while an outsider opens 1,000 silent sockets a
    second: silent clients may hold only half of what the process has spare, so a peer still
    connects within a second and (shm) the descriptor of the region it grants in is received;
    what the victim writes there lands byte-exactly. (Silent clients were bounded by 4,096
    whatever the limit: the process stayed at it, the shm peer's connection was closed as
    "SHM_REGION frame without a file descriptor" and a tcp peer waited ~3 s to connect.)"""
    # A connect timeout past 2 s: the listener then drops a silent client after 2 s, as by default.
    victim = VictimProcess(backend, connect_timeout=5.0, limit_setup=LOWER_DESCRIPTOR_LIMIT)
    try:
        with silent_flood(backend, victim.endpoint, 1000) as at_full_rate:
            connected_in = connect_and_receive_a_write(victim, backend)
            at_full_rate()
        assert connected_in < 1, f"connecting took {connected_in:.2f} s"
    finally:
        victim.assert_alive()
        victim.stop()


def test_a_flood_on_one_listener_leaves_the_processs_other_listener_open():
    """shm peers of a process whose tcp listener is flooded with silent sockets (the share of
    descriptors is the process's, the clients each listener's) still connect within a second: a
    listener makes room among its own clients, never by refusing a newcomer for another's."""
    flooded_port = free_port()
    second_listener = LOWER_DESCRIPTOR_LIMIT + textwrap.dedent(f'''
        from tests.transport.helpers import HOST, transport
        victim.flooded = transport("tcp", "victim", connect_timeout=5.0)
        victim.flooded_listener = victim.flooded.listen(f"{{HOST}}:{flooded_port}")
        ''')
    victim = VictimProcess("shm", connect_timeout=5.0, limit_setup=second_listener)
    try:
        with silent_flood("tcp", f"{HOST}:{flooded_port}", 1000) as at_full_rate:
            took = [connect_and_receive_a_write(victim, "shm") for _ in range(5)]
            at_full_rate()
        assert max(took) < 1, f"connecting took {took} s"
    finally:
        victim.assert_alive()
        victim.stop()


def connect_and_receive_a_write(victim, backend):
    """A member connects to the victim and grants 1 MiB (over shm: the region's descriptor
    passes), the victim writes it, it lands byte-exactly; how long connecting took."""
    member = transport(backend, "member", connect_timeout=10)
    victim.process.stdin.write("hold\n")
    victim.process.stdin.flush()
    started = time.monotonic()
    connection = member.connect(victim.endpoint)
    connected_in = time.monotonic() - started
    assert victim.answer() == {"peer": "member"}
    length = 1 << 20
    region = member.allocate_region(length)
    grant = connection.grant(100, region, 0, length)
    answer = victim.ask(f"write 100 {length}")  # waits for the grant to reach the victim
    assert answer["write"][0] == "ok", answer
    assert grant.wait(10) == length
    assert bytes(memoryview(region)) == pattern(length, seed=100)
    print(f"\n{backend}: connected in {connected_in:.2f} s")
    connection.close()
    return connected_in


def test_a_descriptor_that_cannot_be_received_is_this_processs_shortage_not_the_peers_fault():
    """shm only: the victim has no descriptor left when a peer shares a region; the kernel drops
    the region's descriptor (MSG_CTRUNC). The connection ends with a ResourceLimitError naming
    RLIMIT_NOFILE and `ulimit -n`, and the peer is told so (it was told it broke the protocol by
    sending SHM_REGION without a descriptor)."""
    victim = VictimProcess("shm", limit_setup=LOWER_DESCRIPTOR_LIMIT)  # few to exhaust, whatever the caller's
    try:
        peer = victim.holding_raw_peer(KEY, "sharer")
        exhausted = victim.ask("exhaust_descriptors")
        assert exhausted["stopped_by"] == "Too many open files", exhausted
        peer.share_region(1, 4096)
        reason = peer.receive_until_closed()
        victim.ask("release_descriptors")
        assert reason and "out of file descriptors" in reason and "RLIMIT_NOFILE" in reason, reason
        assert "broke the tf_rdma protocol" not in reason, reason
        kind, message = victim.ask("write 100 10")["write"]
        assert kind == "ResourceLimitError", (kind, message)
        assert "out of file descriptors" in message and "ulimit -n" in message and "sharer" in message, message
        peer.close()
    finally:
        victim.assert_alive()
        victim.stop()
