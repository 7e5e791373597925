"""Runs in guest-a of the two linked Soft-RoCE guests (tests/softroce/test_two_hosts.py), with the
peer on guest-b: which RDMA device verbs uses for a peer when the host has several.

guest-a has rxe1 on a dummy netdev (created first, so listed first; it reaches nothing outside
guest-a: rxe devices of one 6.1 kernel cannot reach each other either) and rxe0 on eth0, the link
to guest-b. The peer listens on guest-b through the peer agent (helpers.start_peer). Not named
test_*: it runs only in that guest, by path.
"""
import os
import time
from pathlib import Path

import pytest

from tests.transport.helpers import next_line, pattern, raises_exactly, start_peer, transport, wait_for_line
from tf_rdma import errors

PEER_IP = os.environ["SOFTROCE_PEER_IP"]
ROUTED, UNROUTED = "rxe0", "rxe1"
SIZE = 1 << 20

pytestmark = pytest.mark.peer_process


def packets_sent(device):
    return int(Path(f"/sys/class/infiniband/{device}/ports/1/hw_counters/sent_pkts").read_text())


@pytest.fixture
def peer():
    """A verbs peer listening on guest-b that checks the bytes it receives: (process, endpoint)."""
    process = start_peer("verbs", f"listen:{PEER_IP}:0", f"expect:1:{SIZE}:7", "print:received", "sleep:60")
    try:
        line = next_line(process, timeout=60)
        assert line.startswith("listening "), line
        yield process, line.split()[1]
    finally:
        process.kill()
        process.wait()


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    for name in ("TF_RDMA_VERBS_DEVICE", "TF_RDMA_VERBS_PORT", "TF_RDMA_VERBS_GID_INDEX"):
        monkeypatch.delenv(name, raising=False)


def send_across(peer):
    process, endpoint = peer
    local = transport("verbs", "guest-a", connect_timeout=30)  # held: its connections end with it
    connection = local.connect(endpoint)
    wait_for_line(process, "connected")
    connection.write(1, pattern(SIZE, seed=7)).wait(60)
    wait_for_line(process, "received", timeout=60)  # the peer checked every byte


def test_guest_a_has_two_devices():
    assert {ROUTED, UNROUTED} <= set(os.listdir("/sys/class/infiniband")), os.listdir("/sys/class/infiniband")


def test_without_an_override_the_peer_is_reached_through_the_device_its_route_leaves_by(peer):
    before = {device: packets_sent(device) for device in (ROUTED, UNROUTED)}
    send_across(peer)
    assert packets_sent(ROUTED) - before[ROUTED] >= SIZE // 4096  # at least one packet per MTU
    assert packets_sent(UNROUTED) == before[UNROUTED]


def test_naming_the_routed_device_works(peer, monkeypatch):
    monkeypatch.setenv("TF_RDMA_VERBS_DEVICE", ROUTED)
    send_across(peer)


def test_naming_a_device_that_cannot_reach_the_peer_fails_at_once_naming_both(peer, monkeypatch):
    monkeypatch.setenv("TF_RDMA_VERBS_DEVICE", UNROUTED)
    _, endpoint = peer
    started = time.monotonic()
    with raises_exactly(errors.BackendUnavailableError) as raised:
        transport("verbs", "guest-a", connect_timeout=30).connect(endpoint)
    message = str(raised.value)
    # What a user needs: the peer, the device they asked for and the one that reaches the peer.
    assert endpoint.rsplit(":", 1)[0] in message, message
    # (Not its exact wording, which may improve.)
    assert "TF_RDMA_VERBS_DEVICE" in message and UNROUTED in message and ROUTED in message, message
    assert time.monotonic() - started < 10  # a wrong device is not retried until the connect timeout


def test_naming_a_device_that_does_not_exist_lists_both_real_ones(monkeypatch):
    monkeypatch.setenv("TF_RDMA_VERBS_DEVICE", "mlx5_0")
    with raises_exactly(errors.ConfigError) as raised:
        transport("verbs", "guest-a")
    message = str(raised.value)
    assert "TF_RDMA_VERBS_DEVICE=mlx5_0 does not exist" in message, message
    assert ROUTED in message and UNROUTED in message, message
