"""Sizes in bytes as people write and read them: the one grammar of sizes (binary units; the
C++ core's ParseSize, cc/transport/settings.h, which TF_RDMA_* sizes use too) and the one way the
reports print them."""
from tf_rdma import _transport


def parse_size(text):
    """8, "4096", "4K", "64KiB", "1M", "16MiB", "1 GB", "1T", "1TiB" -> bytes (binary units, any
    case); raises ConfigError (a ValueError) saying what a size is."""
    return _transport.parse_size(str(text))


def parse_sizes(text):
    """"1M,16M" (or a list of sizes) -> [1048576, 16777216]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [parse_size(item) for item in items if str(item).strip()]


def format_size(n):
    """1048576 -> "1 MiB"; a size that is no whole number of KiB, MiB, GiB or TiB stays in bytes."""
    return _transport.format_size(n)
