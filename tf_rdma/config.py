"""TF_RDMA_* configuration, parsed and validated by the C++ core (cc/transport/config.cc), the one
place that knows the variables."""
import dataclasses
import os

from tf_rdma import _transport


@dataclasses.dataclass(frozen=True)
class Config:
    backend: str
    peer_timeout: float      # seconds
    connect_timeout: float   # seconds
    secret: bytes
    port_offset: int = 1000  # TF_RDMA_PORT_OFFSET
    verbs_device: str = ""   # TF_RDMA_VERBS_DEVICE; "" = the device rdma_cm resolves
    verbs_port: int = 0      # TF_RDMA_VERBS_PORT; 0 = the port rdma_cm resolves
    verbs_gid_index: int = -1  # TF_RDMA_VERBS_GID_INDEX; -1 = the RoCE v2 GID rdma_cm resolves
    verbs_poll_us: int = 100  # TF_RDMA_VERBS_POLL_US; 0 = sleep on completion events at once
    stream_poll_us: int = 0  # TF_RDMA_STREAM_POLL_US (tcp, shm); 0 = sleep at once
    io_threads: int = 2      # TF_RDMA_IO_THREADS: threads serving all connections
    # Bounds on what peers can make this process spend (defaults: cc/transport/transport.h).
    max_concurrent_handshakes: int = 64              # TF_RDMA_MAX_CONCURRENT_HANDSHAKES
    max_grants_per_peer: int = 65536                 # TF_RDMA_MAX_GRANTS_PER_PEER
    shm_max_mapped_bytes_per_peer: int = 64 << 30    # TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER
    data_prefetch_elements: int = 2  # TF_RDMA_DATA_PREFETCH_ELEMENTS (tf.data service trainers)
    shm_max_mapped_bytes_total: int = 1 << 40        # TF_RDMA_SHM_MAX_MAPPED_BYTES_TOTAL
    max_connections_per_peer_name: int = 16          # TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME
    receive_pool_idle: float = 30.0  # TF_RDMA_RECEIVE_POOL_IDLE_MS, seconds; 0 = keep regions

    def cluster_key(self) -> bytes:
        """The key peers prove to each other in the handshake, derived from the secret alone
        (cc/transport/config.h, ClusterKey)."""
        return _transport.cluster_key(self.secret)


def load_config(environ=None) -> Config:
    """Reads TF_RDMA_* from `environ` (default: the process environment); raises ConfigError."""
    environ = os.environ if environ is None else environ
    values = {k: v for k, v in environ.items() if k.startswith("TF_RDMA_")}
    return Config(**_transport.parse_config(values))


def variables():
    """(name, default, meaning) of every TF_RDMA_* variable."""
    return _transport.config_variables()
