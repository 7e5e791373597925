"""A listener under exhausted resources, for real, in a child process with lowered limits: it must
back off and keep serving, never end its accept loop or abort the process."""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import wire_client as w
from helpers import next_line, transport
from tf_rdma import errors

pytestmark = pytest.mark.stream_backends_only

HELPERS = str(Path(__file__).parent)


def listener_in_child(backend, limit_setup, connect_timeout):
    """A tf_rdma listener in a child process whose limits `limit_setup` (Python code) lowered. It
    prints its endpoint, then the name of every peer it accepts, until stdin closes."""
    script = textwrap.dedent(f'''
        import resource, sys, threading
        sys.path.insert(0, {HELPERS!r})
        from helpers import HOST, transport
        receiver = transport({backend!r}, "receiver", connect_timeout={connect_timeout})
        listener = receiver.listen(f"{{HOST}}:0")
    ''') + textwrap.dedent(limit_setup) + textwrap.dedent('''
        print(listener.endpoint, flush=True)
        def accept_all():
            while True:
                try:
                    print("accepted", listener.accept(3600).peer_name, flush=True)
                except Exception as e:
                    print("accept failed", e, flush=True)
                    return
        threading.Thread(target=accept_all, daemon=True).start()
        sys.stdin.read()
    ''')
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def run_exhaustion(backend, limit_setup, connections, connect_timeout=2):
    child = listener_in_child(backend, limit_setup, connect_timeout)
    try:
        child.endpoint = next_line(child)
        silent = [w.RawPeer(backend, child.endpoint) for _ in range(connections)]
        time.sleep(1.0)  # the child runs into its limit accepting them
        assert child.poll() is None, f"the listener's process died: {child.stderr.read()}"
        for peer in silent:
            peer.close()
        time.sleep(0.5)  # their handshakes end
        assert member_connects(backend, child), "the listener stopped serving"
        assert child.poll() is None
    finally:
        child.stdin.close()
        child.wait(10)
    return child.stderr.read()


def test_running_out_of_descriptors_does_not_end_the_accept_loop(backend):
    # Room for a few handshakes above what is open now; the silent clients exhaust it.
    logged = run_exhaustion(backend, '''
        import os
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    ''', connections=20)
    assert "Too many open files" in logged, logged


def test_failing_to_start_a_handshake_thread_refuses_that_client_only(backend):
    # Address space for a few thread stacks more than the process has now: thread creation fails.
    logged = run_exhaustion(backend, '''
        def mapped_bytes():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + (40 << 20), resource.RLIM_INFINITY))
    ''', connections=20)
    assert "cannot start a thread" in logged, logged
