"""tf_rdma: TensorFlow's cross-task tensors over one-sided RDMA writes instead of gRPC.

Importing the package validates every TF_RDMA_* environment variable, so a typo or a bad value
fails at once with a message naming the variable and the fix.
"""
from tf_rdma import errors
from tf_rdma.config import Config, load_config
from tf_rdma.errors import (
    BackendUnavailableError,
    CancelledError,
    ConfigError,
    HandshakeError,
    MessageTooLargeError,
    MissingLibraryError,
    OperationTimeoutError,
    PeerUnavailableError,
    ProtocolError,
    TensorFlowMismatchError,
    TransportError,
)

__version__ = "0.1.0"

config = load_config()


_TENSORFLOW_SIDE = ("Server", "MultiWorkerMirroredStrategy", "ParameterServerStrategy", "connect_to_cluster",
                    "protocol", "stats", "reset_stats")


def __getattr__(name):
    # TensorFlow is imported only when its side of tf_rdma is asked for: the transport, its CLI and
    # its tests do without it.
    if name == "DATA_TRANSFER_PROTOCOL":
        from tf_rdma import server
        return server.data_transfer_protocol()
    if name in ("dtensor", "keras"):
        import importlib
        return importlib.import_module(f"tf_rdma.{name}")
    if name in _TENSORFLOW_SIDE:
        from tf_rdma import server
        return getattr(server, name)
    raise AttributeError(f"module 'tf_rdma' has no attribute {name!r}")

__all__ = [
    "BackendUnavailableError", "CancelledError", "Config", "DATA_TRANSFER_PROTOCOL", *_TENSORFLOW_SIDE, "ConfigError", "HandshakeError",
    "MessageTooLargeError", "MissingLibraryError", "OperationTimeoutError", "PeerUnavailableError", "ProtocolError",
    "TensorFlowMismatchError", "TransportError", "config", "dtensor", "errors", "keras", "load_config",
]
