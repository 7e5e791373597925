"""shm-specific: a receiver shares its regions as sealed memfds; a hostile receiver cannot make the
sender write outside what it mapped, or crash it by shrinking a region under it."""
import fcntl
import mmap
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from tests.transport import wire_client as w
from tests.transport.helpers import KEY, connected_pair, next_line, raw_peer_connected, transport
from tf_rdma import errors


@pytest.fixture
def hostile_receiver_factory():
    """Makes tf_rdma senders (transport options as given) connected to a raw peer that plays a
    (broken) shm receiver."""
    peers = []

    def make(**options):
        sender_side, listener, raw, connection = raw_peer_connected("shm", "sender", **options)
        peers.append((sender_side, listener, raw))
        return raw, connection

    yield make
    for _, _, raw in peers:
        raw.close()


@pytest.fixture
def hostile_receiver(hostile_receiver_factory):
    return hostile_receiver_factory()


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


def test_a_region_is_shared_once_per_connection_and_reused():
    """A raw sender counts the SHM_REGION frames a tf_rdma receiver sends: one per region, however
    many grants use it, and the grants land through that one mapping."""
    receiver, listener, raw, from_sender = raw_peer_connected("shm", "receiver")
    regions = [receiver.allocate_region(1 << 20), receiver.allocate_region(4096)]
    shared, mappings = [], {}
    try:
        for i in range(50):
            region = regions[0] if i % 10 else regions[1]
            grant = from_sender.grant(i, region, (i % 4) * 1000, 1000)
            kind, body, fds = raw.receive_with_fds()
            while kind == w.SHM_REGION:
                region_id, size = struct.unpack("<IQ", body)
                shared.append(region_id)
                mappings[region_id] = mmap.mmap(fds[0], size)
                os.close(fds[0])
                kind, body, fds = raw.receive_with_fds()
            assert kind == w.GRANT and not fds, kind
            grant_id, _, _, region_id, offset, capacity = struct.unpack("<QQQIQQ", body)
            mappings[region_id][offset:offset + 1000] = bytes([i]) * 1000
            raw.send(w.data(grant_id, 1000))
            assert grant.wait(10) == 1000
            assert memoryview(region)[(i % 4) * 1000:(i % 4 + 1) * 1000] == bytes([i]) * 1000
        assert len(shared) == len(set(shared)) == 2, shared
    finally:
        for mapping in mappings.values():
            mapping.close()
        raw.close()


def test_regions_from_another_backend_cannot_be_granted():
    with connected_pair("shm") as (_, from_sender, _to_receiver):
        foreign = transport("tcp", "other").allocate_region(100)
        with pytest.raises(errors.ConfigError, match="allocated by the shm transport"):
            from_sender.grant(1, foreign, 0, 100).wait(1)


def sender_in_child(script_body):
    """Runs a tf_rdma shm sender in a child process, so that a crash (SIGBUS) fails the test instead
    of killing the test run. The child listens, prints its endpoint, accepts one raw peer, runs
    `script_body` (with `connection` bound) and prints what it reports."""
    script = textwrap.dedent('''
        from tests.transport.helpers import HOST, transport
        from tf_rdma import errors
        sender_side = transport("shm", "sender")
        listener = sender_side.listen(f"{{HOST}}:0")
        print(listener.endpoint, flush=True)
        connection = listener.accept(10)
    ''') + textwrap.dedent(script_body)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_an_empty_region_cannot_be_granted_a_byte():
    """A sealed 0-byte memfd is mapped as one page, but none of it exists: writing there would
    raise SIGBUS. The grant must be refused against the region's real size."""
    child = sender_in_child('''
        try:
            connection.write(1, b"x").wait(10)
            print("written")
        except errors.TransportError as e:
            print(type(e).__name__, e)
    ''')
    raw = w.RawPeer("shm", next_line(child))
    raw.handshake(KEY)
    raw.share_region(1, 0)
    raw.send(w.grant(1, 0, 1, 1, 0, 1))
    out = next_line(child)
    child.wait(30)
    raw.close()
    assert child.returncode == 0, f"sender died with {child.returncode}: {child.stderr.read()}"
    assert out.startswith("ProtocolError") and "outside region 1 of 0 bytes" in out, out


def test_a_peer_cannot_make_us_map_more_than_the_per_peer_limit(hostile_receiver_factory):
    raw, connection = hostile_receiver_factory(shm_max_mapped_bytes_per_peer=1 << 20)
    raw.share_region(1, 512 << 10)
    raw.share_region(2, 512 << 10)  # exactly the limit
    time.sleep(0.2)
    connection.check()
    raw.share_region(3, 1)
    expect_refused(raw, connection,
                   r"more than 1048576 .*TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER")


def test_a_sparse_region_the_size_of_the_address_space_is_refused_before_mapping(hostile_receiver):
    raw, connection = hostile_receiver
    raw.share_region(1, 64 << 40)  # 64 TiB, sparse: costs the peer nothing
    expect_refused(raw, connection, "TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER")


def test_the_number_of_regions_a_peer_shares_is_bounded(hostile_receiver):
    raw, connection = hostile_receiver
    for region_id in range(1, 4097):
        raw.share_region(region_id, 0)
    time.sleep(0.5)
    connection.check()
    raw.share_region(4097, 0)
    expect_refused(raw, connection, "more than 4096 regions")


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_passed_with_other_frames_are_closed_and_refused(hostile_receiver):
    raw, connection = hostile_receiver
    before = open_descriptors()
    spares = [os.memfd_create("spare") for _ in range(4)]
    try:
        for _ in range(50):
            socket.send_fds(raw.sock, [w.frame(w.PING)], spares)
            time.sleep(0.005)
    except OSError:
        pass  # the connection was closed under the flood, as it should be
    finally:
        for fd in spares:
            os.close(fd)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and connection_is_healthy(connection):
        time.sleep(0.05)
    with pytest.raises(errors.ProtocolError, match="4 file descriptors with a PING frame"):
        connection.check()
    assert open_descriptors() <= before, "descriptors a peer passed stayed open"


def connection_is_healthy(connection):
    try:
        connection.check()
        return True
    except errors.TransportError:
        return False


def test_a_descriptor_is_charged_to_the_frame_that_ends_the_send_that_passed_it(hostile_receiver):
    """The reader takes a burst of frames in one receive, and the kernel ends a receive with the
    send that passed descriptors: frames read in the same receive before a SHM_REGION frame, even
    sent with it, must not be charged with its descriptor, and the grant that uses the region must
    work."""
    raw, connection = hostile_receiver
    fd = os.memfd_create("burst-region", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    mapped = mmap.mmap(fd, 4096)
    try:
        pings = b"".join(w.frame(w.PING) for _ in range(200))
        socket.send_fds(raw.sock, [pings + w.frame(w.SHM_REGION, struct.pack("<IQ", 1, 4096))], [fd])
        raw.send(b"".join(w.frame(w.PING) for _ in range(200)) + w.grant(1, 0, 1, 1, 100, 64))
        connection.write(1, b"\x42" * 64).wait(10)
        connection.check()
        assert mapped[100:164] == b"\x42" * 64 and mapped[:100] == b"\0" * 100
    finally:
        mapped.close()
        os.close(fd)
