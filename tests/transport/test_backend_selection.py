"""TF_RDMA_BACKEND: what `auto` picks for a peer and why, and explicit backends that cannot work
being errors rather than silent substitutes. The TensorFlow runtime calls the same choice
(Runtime::ConnectTo); tests/tf/test_tf2.py checks the reason a real cluster reports."""
import logging

import pytest

from tests.transport.helpers import HOST, raises_exactly, transport
from tf_rdma import _transport, errors
from tf_rdma.transport import BACKENDS, STREAM_BACKENDS, available_backends, choose_backend

# TEST-NET-2 (RFC 5737): never an address of this host, and no packet is sent to it.
ANOTHER_HOST = "198.51.100.7"


@pytest.mark.parametrize("peer_host", sorted({"127.0.0.1", "localhost", HOST}))
def test_auto_picks_shm_for_a_peer_on_this_host_and_says_why(peer_host):
    assert _transport.choose_backend("auto", peer_host) == ("shm", "peer is on this host")


def test_auto_for_a_peer_on_another_host_takes_verbs_if_an_rdma_device_reaches_it_else_tcp_saying_why():
    backend, reason = _transport.choose_backend("auto", ANOTHER_HOST)
    verbs_usable, why_not = _transport.backend_available("verbs")
    if not verbs_usable:
        assert (backend, reason) == ("tcp", f"verbs unusable: {why_not}")
    elif backend == "verbs":  # the route to it leaves through an RDMA device's interface
        assert reason == "an RDMA device reaches the peer"
    else:
        assert (backend, reason.split(": ", 2)[:2]) == ("tcp", ["verbs unusable", f"no RDMA device reaches {ANOTHER_HOST}"])


def test_the_choice_and_its_reason_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tf_rdma"):
        assert choose_backend("127.0.0.1", requested="auto") == "shm"
    assert "tf_rdma: shm backend for peer 127.0.0.1 (peer is on this host)" in caplog.messages


def test_an_explicit_backend_is_taken_as_said(backend):
    assert _transport.choose_backend(backend, HOST) == (backend, "TF_RDMA_BACKEND says so")


def test_explicit_shm_to_another_host_is_a_configuration_error():
    # What TensorFlow's runtime asks (Runtime::ConnectTo), and so what a TensorFlow step raises
    # (tests/tf/test_tf1.py: test_explicit_shm_to_a_task_on_another_host_is_a_configuration_error).
    with raises_exactly(errors.ConfigError, match=f"TF_RDMA_BACKEND=shm but peer {ANOTHER_HOST} is on another host"):
        _transport.choose_backend("shm", ANOTHER_HOST)
    # The transport itself refuses too, at once rather than after the connect timeout.
    with raises_exactly(errors.ConfigError, match="shm backend reaches only peers on this host"):
        transport("shm", connect_timeout=30).connect(f"{ANOTHER_HOST}:5")


def test_every_registered_backend_says_whether_it_works_here_and_why_not():
    assert {"tcp", "shm"} <= set(STREAM_BACKENDS) < set(BACKENDS)
    for name, why_not in available_backends().items():
        assert why_not is None or why_not, f"{name} is unusable without saying why"
    assert available_backends()["tcp"] is None


def test_an_unknown_backend_is_refused_naming_the_registered_ones():
    with raises_exactly(errors.ConfigError, match=f"unknown backend 'rdma'; expected one of: {', '.join(BACKENDS)}"):
        _transport.backend_available("rdma")


@pytest.mark.parametrize("requested", ["tcp", "shm", "auto"])
def test_a_peer_host_that_does_not_resolve_is_an_error_naming_it(requested):
    with raises_exactly(errors.ConfigError, match="cannot resolve host 'no-such-host.invalid'"):
        _transport.choose_backend(requested, "no-such-host.invalid")
