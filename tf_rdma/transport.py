"""The transport layer for Python: tf_rdma._transport plus backend selection that logs its choice."""
import logging

from tf_rdma import _transport
from tf_rdma.config import load_config

log = logging.getLogger("tf_rdma")

Transport = _transport.Transport
Connection = _transport.Connection
Region = _transport.Region

# Every backend this build has, as the extension registers them (cc/transport/backend_registry.h).
BACKENDS = tuple(name for name, _ in _transport.backends())
# Those carrying the stream wire format over a socket, which run on every Linux host.
STREAM_BACKENDS = tuple(name for name, stream_wire in _transport.backends() if stream_wire)


def available_backends():
    """{backend: reason it is unusable here, or None if usable} for this process, as the extension's
    registry says."""
    result = {}
    for name in BACKENDS:
        usable, reason = _transport.backend_available(name)
        result[name] = None if usable else reason
    return result


def choose_backend(peer_host, requested=None):
    """The backend for a peer on `peer_host`, per TF_RDMA_BACKEND (or `requested`); logs why."""
    requested = requested or load_config().backend
    backend, reason = _transport.choose_backend(requested, peer_host)
    log.info("tf_rdma: %s backend for peer %s (%s)", backend, peer_host, reason)
    return backend
