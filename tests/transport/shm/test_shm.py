"""shm-specific: a receiver shares its regions as sealed memfds; a hostile receiver cannot make the
sender write outside what it mapped, or crash it by shrinking a region under it."""
import time

import pytest

import wire_client as w
from helpers import HOST, KEY, connected_pair, transport
from tf_rdma import errors


@pytest.fixture
def hostile_receiver():
    """A tf_rdma sender connected to a raw peer that plays a (broken) shm receiver."""
    sender_side = transport("shm", "sender")
    listener = sender_side.listen(f"{HOST}:0")
    raw = w.RawPeer("shm", listener.endpoint)
    raw.handshake(KEY)
    connection = listener.accept(10)
    yield raw, connection
    raw.close()


def expect_refused(raw, connection, expected):
    write = connection.write(1, b"x" * 64)
    with pytest.raises(errors.ProtocolError, match=expected):
        write.wait(10)
    assert "broke the tf_rdma protocol" in raw.receive_until_closed()


def test_region_that_is_not_sealed_is_refused(hostile_receiver):
    raw, connection = hostile_receiver
    raw.share_region(1, 4096, seal=False)
    expect_refused(raw, connection, "not a sealed region")


def test_region_whose_declared_size_is_a_lie_is_refused(hostile_receiver):
    raw, connection = hostile_receiver
    raw.share_region(1, 4096, declared_size=1 << 30)
    expect_refused(raw, connection, "not a sealed region of 1073741824 bytes")


def test_grant_past_the_end_of_a_shared_region_is_refused(hostile_receiver):
    raw, connection = hostile_receiver
    raw.share_region(1, 4096)
    raw.send(w.grant(1, 0, 1, 1, 4000, 200))
    expect_refused(raw, connection, "outside region 1")


def test_grant_in_a_region_never_shared_is_refused(hostile_receiver):
    raw, connection = hostile_receiver
    raw.send(w.grant(1, 0, 1, 42, 0, 10))
    expect_refused(raw, connection, "never shared")


def test_region_frame_without_descriptor_is_refused(hostile_receiver):
    raw, connection = hostile_receiver
    raw.send(w.frame(w.SHM_REGION, b"\1\0\0\0" + (4096).to_bytes(8, "little")))
    expect_refused(raw, connection, "without a file descriptor")


def test_a_region_is_shared_once_per_connection_and_reused(monkeypatch):
    with connected_pair("shm") as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(1 << 20)
        for i in range(50):
            grant = from_sender.grant(i, region, (i % 4) * 1000, 1000)
            to_receiver.write(i, bytes([i]) * 1000).wait(10)
            assert grant.wait(10) == 1000


def test_regions_from_another_backend_cannot_be_granted():
    with connected_pair("shm") as (_, from_sender, _to_receiver):
        foreign = transport("tcp", "other").allocate_region(100)
        with pytest.raises(errors.ConfigError, match="allocated by the shm transport"):
            from_sender.grant(1, foreign, 0, 100).wait(1)
