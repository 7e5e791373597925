"""TF_RDMA_* configuration, parsed and validated by the C++ core (cc/transport/config.cc) by the
one table of settings (cc/transport/settings.h), which also holds every default."""
import dataclasses
import os
from typing import NamedTuple, Optional

from tf_rdma import _transport


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings in effect; the C++ core fills every field, unset variables at their defaults."""
    backend: str
    peer_timeout: float       # seconds
    connect_timeout: float    # seconds
    secret: bytes             # TF_RDMA_SECRET, or TF_RDMA_SECRET_FILE's contents
    port_offset: int
    verbs_device: str         # "" = the device rdma_cm resolves
    verbs_port: int           # 0 = the port rdma_cm resolves
    verbs_gid_index: int      # -1 = the RoCE v2 GID rdma_cm resolves
    verbs_poll_us: int
    stream_poll_us: int
    io_threads: int
    max_concurrent_handshakes: int
    max_grants_per_peer: int
    shm_max_mapped_bytes_per_peer: int
    shm_max_mapped_bytes_total: int
    max_connections_per_peer_name: int
    data_prefetch_elements: int
    receive_pool_idle: float  # seconds; 0 = keep regions
    max_call_bytes: int
    max_calls_per_peer: int

    def cluster_key(self) -> bytes:
        """The key peers prove to each other in the handshake, derived from the secret alone
        (cc/transport/config.h, ClusterKey)."""
        return _transport.cluster_key(self.secret)


class Setting(NamedTuple):
    """A row of the settings table (cc/transport/settings.h)."""
    name: str
    kind: str                # text, count, milliseconds, microseconds or bytes
    default: str             # as the README states it: "30000", "64 GiB", "auto", "(auto)"
    minimum: Optional[int]   # bounds of a value set, in `unit`; None for text settings
    maximum: Optional[int]
    unit: str                # ms, us, bytes, or "" (counts and text)
    doc: str


def load_config(environ=None) -> Config:
    """Reads TF_RDMA_* from `environ` (default: the process environment); raises ConfigError."""
    environ = os.environ if environ is None else environ
    values = {k: v for k, v in environ.items() if k.startswith("TF_RDMA_")}
    return Config(**_transport.parse_config(values))


def settings():
    """Every TF_RDMA_* setting tf_rdma reads, as Setting rows."""
    return [Setting(*row) for row in _transport.settings()]
