"""The exceptions tf_rdma raises. A C++ status maps onto them in one place, from_status: by the
kind marked where the failure arose (cc/transport/error_kinds.h), else by its code."""


class TransportError(RuntimeError):
    """Base of every tf_rdma transport failure."""


class ConfigError(TransportError, ValueError):
    """A TF_RDMA_* variable or an argument is invalid; the message names it and the fix."""


class TensorFlowMismatchError(ConfigError):
    """This tf_rdma was built against another TensorFlow than the one running; rebuild it."""


class PeerUnavailableError(TransportError, ConnectionError):
    """The peer cannot be reached, died, went silent past the timeout, or closed the connection."""


class HandshakeError(TransportError, ConnectionError):
    """The peer is not a compatible member of this cluster (version or cluster key mismatch)."""


class ProtocolError(TransportError):
    """The peer broke the wire protocol (malformed or hostile frame); the connection was closed."""


class MessageTooLargeError(TransportError):
    """A message did not fit the grant; `needed` says how many bytes a new grant must offer."""

    def __init__(self, message, needed=0):
        super().__init__(message)
        self.needed = needed


class ResourceLimitError(TransportError, MemoryError):
    """A resource limit stopped the operation (e.g. `ulimit -l` too low to register RDMA memory);
    the message names the limit, the amount needed and how to raise it."""


class CancelledError(TransportError):
    """The operation was revoked or its connection closed locally."""


class AbortedError(TransportError):
    """The sender withdrew the message (its step was aborted, or ended); the message names the sender
    and says why."""


class OperationTimeoutError(TransportError, TimeoutError):
    """An operation did not finish within the time the caller allowed."""


class BackendUnavailableError(TransportError):
    """The requested backend cannot work on this host, or toward this peer (no RDMA device reaches
    it, or not the device, port or GID the settings name); the message says why."""


class MissingLibraryError(TransportError):
    """A shared library tf_rdma needs cannot be loaded or is unfit (OpenSSL's libcrypto, for the
    handshake); the message names it and the package that installs it."""


# The kinds C++ marks where a failure arises (cc/transport/error_kinds.h: ErrorKindName). A status
# code is shared by unrelated failures (FAILED_PRECONDITION is a peer of another cluster, a missing
# libcrypto or an RDMA device that does not reach the peer), so a kind, where set, decides.
_BY_KIND = {
    "handshake": HandshakeError,
    "missing_library": MissingLibraryError,
    "rdma_device_mismatch": BackendUnavailableError,
}


# absl::StatusCode values, for statuses with no kind. FAILED_PRECONDITION and PERMISSION_DENIED
# have no class of their own: they mean too many different things.
_BY_CODE = {
    1: CancelledError,
    3: ConfigError,
    4: OperationTimeoutError,
    8: MessageTooLargeError,
    10: AbortedError,
    12: BackendUnavailableError,
    14: PeerUnavailableError,
    15: ProtocolError,
}


def from_status(code, message, needed=0, kind=None):
    if kind is not None:
        return _BY_KIND.get(kind, TransportError)(message)
    cls = _BY_CODE.get(code, TransportError)
    if cls is MessageTooLargeError:
        # RESOURCE_EXHAUSTED without a size is a resource limit, not a message too big for its grant.
        return cls(message, needed) if needed else ResourceLimitError(message)
    return cls(message)
