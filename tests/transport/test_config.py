"""The limits on what peers can make a process spend: defaults, and TF_RDMA_* values checked at
load with errors that name the variable."""
import pytest

from tf_rdma import errors
from tf_rdma.config import load_config


def test_limits_have_defaults():
    config = load_config({})
    assert config.max_concurrent_handshakes == 64
    assert config.max_grants_per_peer == 65536
    assert config.shm_max_mapped_bytes_per_peer == 64 << 30


def test_limits_are_read_from_the_environment():
    config = load_config({"TF_RDMA_MAX_CONCURRENT_HANDSHAKES": "8",
                          "TF_RDMA_MAX_GRANTS_PER_PEER": "1000",
                          "TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER": "512M"})
    assert (config.max_concurrent_handshakes, config.max_grants_per_peer,
            config.shm_max_mapped_bytes_per_peer) == (8, 1000, 512 << 20)
    assert load_config({"TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER": "4096"}).shm_max_mapped_bytes_per_peer == 4096


@pytest.mark.parametrize("name, value", [
    ("TF_RDMA_MAX_CONCURRENT_HANDSHAKES", "0"),
    ("TF_RDMA_MAX_CONCURRENT_HANDSHAKES", "many"),
    ("TF_RDMA_MAX_CONCURRENT_HANDSHAKES", "-1"),
    ("TF_RDMA_MAX_GRANTS_PER_PEER", "0"),
    ("TF_RDMA_MAX_GRANTS_PER_PEER", "1G"),  # sizes take units, counts do not
    ("TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", "0"),
    ("TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", "65T"),  # more than half the address space
    ("TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", "1.5G"),
    ("TF_RDMA_SHM_MAX_MAPPED_BYTES_PER_PEER", "G"),
])
def test_bad_limits_are_errors_naming_the_variable(name, value):
    with pytest.raises(errors.ConfigError, match=f"{name}='{value}' is not a whole number"):
        load_config({name: value})
