"""tcp-specific behaviour."""
import struct

import pytest

from tests.transport import wire_client as w
from tests.transport.helpers import HOST, raw_peer_connected, transport
from tf_rdma import errors


def test_shm_region_frame_on_tcp_is_a_protocol_error():
    receiver, _listener, raw, connection = raw_peer_connected("tcp", "receiver")
    grant = connection.grant(1, receiver.allocate_region(10), 0, 10)
    raw.send(w.frame(w.SHM_REGION, struct.pack("<IQ", 1, 4096)))
    with pytest.raises(errors.ProtocolError, match="SHM_REGION frame on a tcp connection"):
        grant.wait(10)


def test_listening_on_a_taken_port_names_the_problem():
    first = transport("tcp", "first").listen(f"{HOST}:0")
    port = first.endpoint.rsplit(":", 1)[1]
    with pytest.raises(errors.PeerUnavailableError, match="another socket holds the port"):
        transport("tcp", "second").listen(f"{HOST}:{port}")


def test_unresolvable_peer_host_is_a_clear_error():
    with pytest.raises(errors.ConfigError, match="cannot resolve"):
        transport("tcp", "x", connect_timeout=1).connect("no-such-host.invalid:5000")
