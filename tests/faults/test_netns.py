"""tests/harness/netns.py without TensorFlow: a network whose making fails at any step leaves nothing
behind, a stuck command fails naming itself, delay() delays each direction by its figures,
duplicate() copies its share of each direction's datagrams once, limit_rate() caps a TCP
connection each way near its rate, all of them combine with loss, none leaves a process, rule or
qdisc once lifted, and what a delay holds outlives lifting the others. Root only (namespaces);
about 25 s."""
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.harness import netns

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


UDP_PORT = 5001
# Datagrams from a host, each its number (paced: 100 at a time, so no queue on the way overflows).
DATAGRAM_SENDER = f"""
import socket, sys, time
sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for number in range(int(sys.argv[2])):
    sender.sendto(str(number).encode(), (sys.argv[1], {UDP_PORT}))
    if number % 100 == 99:
        time.sleep(0.001)
"""
# How many datagrams arrived, how many distinct ones, and the most copies of one, once none has
# come for a second after the first (which may take seconds: the sender's Python starting on a
# busy machine).
DATAGRAM_COUNTER = f"""
import collections, socket
receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
receiver.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE: root, no drop here
receiver.bind(("0.0.0.0", {UDP_PORT}))
receiver.settimeout(30.0)
copies = collections.Counter()
print("ready", flush=True)
try:
    while True:
        copies[receiver.recv(64)] += 1
        receiver.settimeout(1.0)
except socket.timeout:
    pass
print(sum(copies.values()), len(copies), max(copies.values(), default=0))
"""
THROUGHPUT_PORT = 5002
# Bytes from one TCP connection, counted from its accept to its end: megabits per second.
THROUGHPUT_SINK = f"""
import socket, time
listener = socket.create_server(("0.0.0.0", {THROUGHPUT_PORT}))
print("ready", flush=True)
connection, _ = listener.accept()
started, received = time.monotonic(), 0
while data := connection.recv(1 << 20):
    received += len(data)
print(received * 8 / (time.monotonic() - started) / 1e6)
"""
THROUGHPUT_SOURCE = f"""
import socket, sys, time
connection = socket.create_connection((sys.argv[1], {THROUGHPUT_PORT}))
block, until = bytes(1 << 16), time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    connection.sendall(block)
"""


def measured(net, sender, receiver, measurer, sending, *args, meanwhile=lambda: None):
    """What the script `measurer` prints at its end, run on `receiver` while the script `sending`
    runs on `sender` (with `args`) once the measurer said it is ready; `meanwhile()` runs once the
    sender is done."""
    def python(host, script, *args):
        return ["ip", "netns", "exec", net.namespace(host), sys.executable, "-c", script, *args]
    process = subprocess.Popen(python(receiver, measurer), stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        subprocess.run(python(sender, sending, net.address(receiver), *args), check=True, timeout=60)
        meanwhile()
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    return out


def datagrams(net, sender, receiver, count=10000, meanwhile=lambda: None):
    """(arrived, distinct, most copies of one) of `count` datagrams from `sender` to `receiver`."""
    return tuple(int(n) for n in measured(net, sender, receiver, DATAGRAM_COUNTER, DATAGRAM_SENDER,
                                          str(count), meanwhile=meanwhile).split())


def throughput_mbit(net, sender, receiver, seconds=1.0):
    """Megabits per second of one TCP connection sending for `seconds`, measured at `receiver`."""
    return float(measured(net, sender, receiver, THROUGHPUT_SINK, THROUGHPUT_SOURCE, str(seconds)))


def duplicating_rules(net):
    """The rules of the switch's netdev-family tables (duplicate()'s is the only one)."""
    tables = netns._run("ip", "netns", "exec", net.switch, "nft", "list", "tables", "netdev").split()[2::3]
    return [line for table in tables for line in netns._run(
        "ip", "netns", "exec", net.switch, "nft", "list", "table", "netdev", table).splitlines() if " dup to " in line]


def qdiscs(net):
    """{port: its root qdisc's kind} of every host's port."""
    return {port: netns._run("tc", "-n", net.switch, "qdisc", "show", "dev", port, "root").split()[1]
            for port in net.ports.values()}


def two_hosts(net):
    for host in HOSTS:
        net.add_host(host)


def test_duplication_copies_that_share_of_each_direction_once_and_lifting_it_leaves_no_rule():
    """10% of 10,000 datagrams: 1,000 copies, give or take 3% (seven standard deviations), each
    datagram arriving at most twice."""
    with netns.Network() as net:
        two_hosts(net)
        clean = datagrams(net, "a", "b")
        net.duplicate(10)
        duplicated = {"a->b": datagrams(net, "a", "b"), "b->a": datagrams(net, "b", "a")}
        net.stop_duplicating()
        assert not duplicating_rules(net)
        lifted = datagrams(net, "a", "b")
    print(clean, duplicated, lifted)
    assert clean == lifted == (10000, 10000, 1), (clean, lifted)
    for arrived, distinct, most in duplicated.values():
        assert distinct == 10000 and most == 2, duplicated
        assert 700 < arrived - distinct < 1300, duplicated
    assert not ours()


def test_a_rate_limit_caps_each_direction_and_lifting_it_restores_the_link():
    """50 Mbit/s: one TCP connection each way within 0.8-1.05 of it (TCP halves its window at each
    drop of the full queue); lifted, over ten times it (veths carry gigabits)."""
    with netns.Network() as net:
        two_hosts(net)
        net.limit_rate(50)
        assert set(qdiscs(net).values()) == {"tbf"}
        capped = {"a->b": throughput_mbit(net, "a", "b"), "b->a": throughput_mbit(net, "b", "a")}
        net.unlimit_rate()
        assert set(qdiscs(net).values()) == {"noqueue"}, qdiscs(net)
        lifted = throughput_mbit(net, "a", "b")
    print(capped, lifted)
    assert all(0.8 * 50 < mbit < 1.05 * 50 for mbit in capped.values()), capped
    assert lifted > 500, lifted
    assert not ours()


def test_loss_delay_duplication_and_rate_combine():
    """Copies are made after the loss, of what arrives: of 10,000 datagrams losing 10% and
    duplicating 10%, about 9,000 arrive, and 900 copies of them (each give or take 3%), through
    a delay and a rate limit that lose nothing of the paced datagrams."""
    with netns.Network() as net:
        two_hosts(net)
        net.lose(10)
        net.delay(5, 2)
        net.duplicate(10)
        net.limit_rate(50)
        arrived, distinct, most = datagrams(net, "a", "b")
        net.keep_all()
        net.undelay()
        net.stop_duplicating()
        net.unlimit_rate()
        assert not duplicating_rules(net) and set(qdiscs(net).values()) == {"noqueue"}
        assert datagrams(net, "b", "a") == (10000, 10000, 1)
    print(arrived, distinct, most)
    assert 8700 < distinct < 9300 and 600 < arrived - distinct < 1200 and most == 2, (arrived, distinct, most)
    assert not ours()


def test_duplication_and_rate_misused_say_how_and_change_nothing():
    with netns.Network() as net:
        two_hosts(net)
        for wrong in (0, 101, 1.5, True, "10"):
            with pytest.raises(ValueError, match="give a whole percentage from 1 to 100"):
                net.duplicate(wrong)
            with pytest.raises(ValueError, match="give a whole percentage from 1 to 100"):
                net.lose(wrong)
        for wrong in (0, -1, 200_000, "10", None):
            with pytest.raises(ValueError, match="give megabits per second"):
                net.limit_rate(wrong)
        with pytest.raises(RuntimeError, match="no duplication is applied"):
            net.stop_duplicating()
        with pytest.raises(RuntimeError, match="no rate limit is applied"):
            net.unlimit_rate()
        with pytest.raises(RuntimeError, match="no loss is applied"):
            net.keep_all()
        assert not duplicating_rules(net) and set(qdiscs(net).values()) == {"noqueue"} and not net.rules
        net.duplicate(5)
        net.limit_rate(100)
        net.lose(1)
        with pytest.raises(RuntimeError, match="5% duplication is applied already"):
            net.duplicate(5)
        with pytest.raises(RuntimeError, match="a rate limit of 100 Mbit/s is applied already"):
            net.limit_rate(10)
        with pytest.raises(RuntimeError, match="loss is applied already"):
            net.lose(1)
        assert duplicating_rules(net) and set(qdiscs(net).values()) == {"tbf"}


def test_a_host_joining_a_duplicating_capped_network_gets_both_and_one_cut_off_does_not_stop_the_lifting():
    with netns.Network() as net:
        two_hosts(net)
        net.duplicate(10)
        net.limit_rate(50)
        net.add_host("c")
        assert set(qdiscs(net).values()) == {"tbf"} and len(qdiscs(net)) == 3
        arrived, distinct, _ = datagrams(net, "a", "c")
        assert distinct == 10000 and 700 < arrived - distinct < 1300, (arrived, distinct)
        net.cut_off("b")
        net.stop_duplicating()
        net.unlimit_rate()
        assert not duplicating_rules(net) and set(qdiscs(net).values()) == {"noqueue"}
        assert datagrams(net, "c", "a") == (10000, 10000, 1)
    assert not ours()


def test_what_the_delay_holds_outlives_stopping_duplication_and_a_host_cut_off_ends_only_its_own():
    """Deleting a netfilter hook (an nftables base chain, or the device it hooks) makes the kernel
    drop every packet an NFQUEUE holds: stop_duplicating() deletes none, so all 2,000 datagrams
    held 300 ms arrive; a host cut off while packets to it are held loses them (the kernel drops
    them from the queue, and the delayer's verdicts for them fail), and the delay goes on."""
    with netns.Network() as net:
        two_hosts(net)
        net.add_host("c")
        net.duplicate(10)
        net.delay(300)
        arrived, distinct, _ = datagrams(net, "a", "b", 2000, meanwhile=net.stop_duplicating)
        assert distinct == 2000, (arrived, distinct)
        counter = subprocess.Popen(["ip", "netns", "exec", net.namespace("c"), sys.executable, "-c",
                                    DATAGRAM_COUNTER], stdout=subprocess.PIPE, text=True)
        try:
            assert counter.stdout.readline() == "ready\n"
            subprocess.run(["ip", "netns", "exec", net.namespace("a"), sys.executable, "-c", DATAGRAM_SENDER,
                            net.address("c"), "2000"], check=True, timeout=60)
            net.cut_off("c")
        finally:
            counter.kill()
            counter.wait()
        assert datagrams(net, "a", "b", 2000) == (2000, 2000, 1)
        net.undelay()
    assert not ours()
