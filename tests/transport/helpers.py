"""Shared pieces of the transport tests: connected pairs, peer processes, payload patterns."""
import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.transport.remote_process import RemoteProcess
from tf_rdma import _transport

KEY = b"test-cluster-key"
HOST = os.environ.get("TFRDMA_TEST_HOST", "127.0.0.1")
# Not TF_RDMA_*: tf_rdma refuses TF_RDMA_ variables it does not know (a typo must not pass silently).
PEER_AGENT = os.environ.get("TRANSPORT_TEST_PEER_AGENT", "")


def socket_inodes(pid="self"):
    """The inodes of the sockets process `pid` holds a descriptor of (what a closed connection gives back)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since the listing (the listing's own descriptor, say)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


@contextlib.contextmanager
def raises_exactly(error_class, match=None):
    """pytest.raises that also fails on a subclass of `error_class`: every failure has a class of its
    own (tf_rdma/errors.py), and the test pins which."""
    with pytest.raises(error_class, match=match) as raised:
        yield raised
    assert raised.type is error_class, f"raised {raised.type.__name__}, not {error_class.__name__}: {raised.value}"


def transport(backend, name="local", key=KEY, **kwargs):
    return _transport.Transport(backend, name=name, cluster_key=key, **kwargs)


@contextlib.contextmanager
def connected_pair(backend, receiver_options=None, sender_options=None):
    """(receiver_transport, receiver_side_connection, sender_side_connection), in one process."""
    receiver = transport(backend, "receiver", **(receiver_options or {}))
    sender = transport(backend, "sender", **(sender_options or {}))
    listener = receiver.listen(f"{HOST}:0")
    to_receiver = sender.connect(listener.endpoint)
    from_sender = listener.accept(10)
    try:
        yield receiver, from_sender, to_receiver
    finally:
        to_receiver.close()
        from_sender.close()


def raw_peer_connected(backend, name="local", **options):
    """A tf_rdma listener (transport `options` as given) with a raw wire peer (wire_client.RawPeer)
    handshaken into it: (transport, listener, raw_peer, connection). The caller keeps the
    transport and listener alive while it uses the connection."""
    from tests.transport import wire_client
    local = transport(backend, name, **options)
    listener = local.listen(f"{HOST}:0")
    raw = wire_client.RawPeer(backend, listener.endpoint)
    raw.handshake(KEY)
    return local, listener, raw, listener.accept(10)


def free_port():
    """A TCP port nothing listens on now (also a free shm endpoint: its socket name is per port)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def pattern(size, seed=0):
    """Bytes that vary along a 65521-byte (prime) period and with the seed, so misplaced or stale
    bytes show; built by repetition, so hundreds of MiB cost little."""
    period = 65521
    block = bytes((i * 131 + seed * 97 + i // 256) & 0xFF for i in range(min(size, period)))
    return (block * (size // period + 1))[:size]


def start_peer(backend, endpoint, *actions, key=KEY, peer_timeout=30.0):
    """A sender in another process; `actions` as peer_process.py takes them. With
    TRANSPORT_TEST_PEER_AGENT=HOST:PORT, the process runs on that other host (remote_process.py),
    with that host's environment: the suite across two hosts."""
    argv = [sys.executable, "-m", "tests.transport.peer_process", backend, endpoint, key.hex(), str(peer_timeout), *actions]
    if PEER_AGENT:
        return RemoteProcess(PEER_AGENT, argv)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))


def _stdout_lines(process):
    """A queue of the process's stdout lines (None at its end), fed by a thread: a timeout can
    then fire while the process prints nothing, which a blocking readline() would not allow."""
    if not hasattr(process, "stdout_lines"):
        process.stdout_lines = queue.Queue()

        def read():
            for line in process.stdout:
                process.stdout_lines.put(line)
            process.stdout_lines.put(None)

        threading.Thread(target=read, daemon=True).start()
    return process.stdout_lines


def next_line(process, timeout=30):
    """The next line the process prints, stripped; fails if none comes within `timeout` s."""
    try:
        line = _stdout_lines(process).get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"the process printed nothing within {timeout} s") from None
    if line is None:
        process.stdout_lines.put(None)  # stays at its end for the next caller
        process.wait(10)
        raise AssertionError(f"the process exited ({process.returncode}) without printing more; "
                             f"stderr: {process.stderr.read() if process.stderr else '(not captured)'}")
    return line.strip()


# A peer process's first line comes after its Python, tf_rdma and (verbs) device start: in a
# Soft-RoCE guest's emulation on a loaded host that took over 30 s (make test beside the host lane).
def wait_for_line(process, expected, timeout=60):
    deadline = time.monotonic() + timeout
    while next_line(process, max(0.0, deadline - time.monotonic())) != expected:
        pass


_LISTENING_CHILD = """
import sys
from tests.transport.helpers import HOST, transport
listeners = [transport(backend, "victim").listen(f"{HOST}:0") for backend in sys.argv[1:]]
print(*(listener.endpoint for listener in listeners), flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def listening_child(log_path, backends=("tcp", "shm")):
    """Listeners (named "victim", key KEY) of a process of their own, one per backend:
    {backend: endpoint}. Its log (stderr, warnings shown whatever the caller's shell sets) goes
    to the file `log_path`, complete once the block ends: a fresh process logs the first of each
    rate-limited line, and a file, unlike a pipe, never fills and stalls it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, "-c", _LISTENING_CHILD, *backends], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        yield dict(zip(backends, child.stdout.readline().split()))
    finally:
        child.communicate("done\n", timeout=30)
