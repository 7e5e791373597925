"""Sizes in bytes as people write and read them: the one grammar of the CLI's and the benches'
sizes (binary units), and the one way the reports print them."""
import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "KB": 1 << 10,
          "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30, "GB": 1 << 30}


def parse_size(text):
    """8, "4096", "4K", "1M", "16MiB", "1 GB" -> bytes (binary units, as the CLI's --sizes)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 8, 4K, 1M, 16M)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text):
    """"1M,16M" (or a list of sizes) -> [1048576, 16777216]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [parse_size(item) for item in items if str(item).strip()]


def format_size(n):
    """1048576 -> "1 MiB"; a size that is no whole number of KiB, MiB or GiB stays in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
