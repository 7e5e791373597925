"""tf_rdma/netns.py without TensorFlow: a network whose making fails at any step leaves nothing
behind, a stuck command fails naming itself, and delay() delays each direction by its figures and
leaves no process or rule once lifted. Root only (namespaces); a few seconds."""
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tf_rdma import netns

NEEDS = netns.unavailable_reason("the tests make network namespaces")
pytestmark = pytest.mark.skipif(NEEDS is not None, reason=NEEDS or "")
HOSTS = ("a", "b")


def ours():
    """This process's namespaces (every name carries its id): what another run makes is not ours."""
    return {n for n in netns.namespaces() if n.startswith(f"tfrf{os.getpid()}n")}


def failing_at(n, after):
    """netns._run failing its n-th call: before running the command, or after it ran (as one killed
    at its timeout may have done its work). The calls after it run, as the clean-up's must."""
    calls = itertools.count(1)
    run = netns._run

    def failing(*command, input=None):
        if next(calls) != n:
            return run(*command, input=input)
        if after:
            run(*command, input=input)
        raise RuntimeError(f"injected failure of call {n}: {' '.join(command)}")
    return failing


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_network_failing_at_any_step_of_its_making_leaves_nothing_behind(monkeypatch, after):
    netns.check_tools()
    assert not ours(), "namespaces of an earlier network of this process were left"
    for n in range(1, 100):
        monkeypatch.setattr(netns, "_run", failing_at(n, after))
        try:
            net = netns.Network()
        except RuntimeError as e:
            assert "injected" in str(e)
            assert not ours(), (n, e)
            continue
        try:
            for host in HOSTS:
                net.add_host(host)
        except RuntimeError as e:
            assert "injected" in str(e)
            # The half-made host is gone at once, not only at close(); the hosts before it work.
            assert ours() == {net.switch} | {net.namespace(h) for h in net.hosts}, (n, e)
            assert list(net.hosts) == list(HOSTS[:len(net.hosts)])
            net.close()
            assert not ours(), n
            continue
        monkeypatch.undo()  # no call failed: every step of the making has been failed once
        net.close()
        break
    else:
        pytest.fail("a network of two hosts took 100 commands or more to make")
    assert n > 3 + len(HOSTS), n  # the switch's steps and each host's, at least one each
    assert not ours()


def test_a_host_that_cannot_be_made_is_removed_and_the_network_goes_on():
    with netns.Network() as net:
        net.add_host("a")
        with pytest.raises(RuntimeError, match=r"ip -n \S+-b addr add 10\.213\.0\.300/24"):
            net.add_host("b", address=f"{netns.SUBNET}.300")
        assert ours() == {net.switch, net.namespace("a")}
        assert net.add_host("c") == f"{netns.SUBNET}.2"
    assert not ours()


def test_a_failure_in_the_block_survives_a_close_that_fails_too():
    with pytest.raises(KeyboardInterrupt) as raised:
        with netns.Network() as net:
            netns._run("ip", "netns", "del", net.switch)  # close() will fail to delete it
            raise KeyboardInterrupt
    assert any("closing the network failed too" in note for note in raised.value.__notes__)
    assert not ours()


def test_a_stuck_command_is_killed_at_its_bound_and_named(monkeypatch):
    monkeypatch.setattr(netns, "COMMAND_TIMEOUT_S", 0.2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^sleep 30 did not finish within 0\.2 s"):
        netns._run("sleep", "30")
    assert time.monotonic() - started < 5


ECHO_PORT = 5000
ECHO_SERVER = f"""
import socket
listener = socket.create_server(("0.0.0.0", {ECHO_PORT}))
print("listening", flush=True)
while True:
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := connection.recv(1):
        connection.sendall(data)
"""
# Round trips of one byte over one TCP connection, in ms, one a line.
ECHO_CLIENT = f"""
import socket, sys, time
connection = socket.create_connection((sys.argv[1], {ECHO_PORT}))
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[2])):
    started = time.monotonic()
    connection.sendall(b"x")
    assert connection.recv(1) == b"x"
    print((time.monotonic() - started) * 1000)
"""


class Echo:
    """An echo server on host `b`, timed from host `a`."""

    def __init__(self, net):
        self.net = net
        self.server = subprocess.Popen(["ip", "netns", "exec", net.namespace("b"), sys.executable, "-c", ECHO_SERVER],
                                       stdout=subprocess.PIPE, text=True)
        assert self.server.stdout.readline() == "listening\n"

    def round_trips_ms(self, count=30):
        result = subprocess.run(["ip", "netns", "exec", self.net.namespace("a"), sys.executable, "-c", ECHO_CLIENT,
                                 self.net.address("b"), str(count)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return [float(line) for line in result.stdout.split()]

    def close(self):
        self.server.kill()
        self.server.wait()


def delayers():
    """The processes running tf_rdma's delayer, by pid (ours and any other run's)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(netns.DELAYER).encode() in f.read():
                    found.add(int(pid))
        except OSError:  # gone meanwhile
            pass
    return found


def queue_rules(net):
    return [rule for rule in netns._run("ip", "netns", "exec", net.switch, "iptables-legacy", "-t", "mangle",
                                        "-S", "FORWARD").splitlines() if "NFQUEUE" in rule]


def test_a_delay_delays_each_direction_once_and_lifting_it_leaves_no_process_or_rule():
    """20 ± 5 ms: a round trip crosses the bridge twice, so it takes 30-50 ms (and the scheduler's
    wake-ups on top); lifted, a round trip is back under a millisecond or so."""
    with netns.Network() as net:
        net.add_host("a")
        net.add_host("b")
        echo = Echo(net)
        try:
            clean = echo.round_trips_ms()
            before = delayers()
            net.delay(20, 5, seed=1)
            started = delayers() - before
            assert len(started) == 1 and queue_rules(net), (started, queue_rules(net))
            delayed = echo.round_trips_ms()
            net.lose(1)  # loss and delay at once: the loss rule is nftables', the delay iptables'
            lossy = echo.round_trips_ms(60)
            net.keep_all()
            net.undelay()
            assert not delayers() & started and not queue_rules(net)
            lifted = echo.round_trips_ms()
        finally:
            echo.close()
    summary = {name: (min(v), statistics.median(v), max(v)) for name, v in
               [("clean", clean), ("delayed", delayed), ("lossy", lossy), ("lifted", lifted)]}
    print(summary)
    assert statistics.median(clean) < 5 and statistics.median(lifted) < 5, summary
    assert min(delayed) >= 30 and max(delayed) < 50 + 30, summary
    assert 34 < statistics.median(delayed) < 50, summary  # the sum of two uniform draws: 40
    assert max(delayed) - min(delayed) > 5, summary  # jitter: each packet's own delay
    # A lost packet's retransmission (200 ms and up) only lengthens a round trip.
    assert min(lossy) >= 30 and 34 < statistics.median(lossy) < 50, summary


def test_closing_a_delayed_network_stops_its_delayer():
    before = delayers()
    with netns.Network() as net:
        net.add_host("a")
        net.delay(5)
        assert len(delayers() - before) == 1
    assert not delayers() - before
    assert not ours()


def test_a_delay_misused_says_how_and_changes_nothing():
    before = delayers()
    with netns.Network() as net:
        with pytest.raises(RuntimeError, match="no delay is applied"):
            net.undelay()
        with pytest.raises(ValueError, match="the jitter must be between 0 and the delay"):
            net.delay(5, jitter_ms=6)
        assert not delayers() - before
        net.delay(5)
        with pytest.raises(RuntimeError, match="a delay is applied already"):
            net.delay(5)
        assert len(delayers() - before) == 1
        net.undelay()
    assert not delayers() - before
    assert not ours()


def test_a_delayer_that_cannot_start_is_named_and_leaves_no_rule(monkeypatch, tmp_path):
    failing = tmp_path / "delayer.py"
    failing.write_text("import sys; sys.exit('cannot bind: injected')\n")
    monkeypatch.setattr(netns, "DELAYER", failing)
    with netns.Network() as net:
        with pytest.raises(RuntimeError, match=r"delayer\.py 0 20 5 0 \d+ did not bind its queue: it exited.*"
                                               r"cannot bind: injected"):
            net.delay(20, 5)
        assert net.delayer is None and not queue_rules(net)


def test_a_delayer_that_died_fails_the_lifting_naming_it_and_its_rule_goes():
    with netns.Network() as net:
        net.add_host("a")
        net.delay(20, 5)
        net.delayer.send_signal(signal.SIGKILL)
        net.delayer.wait()
        with pytest.raises(RuntimeError, match=r"nfqueue_delay\.py 0 20 5 0 \d+ failed \(-9\)"):
            net.undelay()
        assert not queue_rules(net)
    assert not ours()
