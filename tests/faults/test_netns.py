"""tf_rdma/netns.py without TensorFlow: a network whose making fails at any step leaves nothing
behind, and a stuck command fails naming itself. Root only (namespaces); a few seconds."""
import itertools
import os
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
