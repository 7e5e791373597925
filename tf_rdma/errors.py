"""The exceptions tf_rdma raises. C++ status codes map onto them in one place, from_status."""


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
    """The sender gave the message up (its step was aborted, or ended); the message names the sender
    and says why."""


class OperationTimeoutError(TransportError, TimeoutError):
    """An operation did not finish within the time the caller allowed."""


class BackendUnavailableError(TransportError):
    """The requested backend cannot work on this host; the message says why."""


# absl::StatusCode values.
_BY_CODE = {
    1: CancelledError,
    3: ConfigError,
    4: OperationTimeoutError,
    7: HandshakeError,
    8: MessageTooLargeError,
    9: HandshakeError,
    10: AbortedError,
    12: BackendUnavailableError,
    14: PeerUnavailableError,
    15: ProtocolError,
}


def from_status(code, message, needed=0):
    cls = _BY_CODE.get(code, TransportError)
    if cls is MessageTooLargeError:
        # RESOURCE_EXHAUSTED without a size is a resource limit, not a message too big for its grant.
        return cls(message, needed) if needed else ResourceLimitError(message)
    return cls(message)
