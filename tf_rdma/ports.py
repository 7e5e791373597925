"""Free ports for local clusters (the benches, the examples and the tests start them)."""
import random
import socket


def _ephemeral_ports():
    """The range the kernel picks ports from for outgoing connections and bind(0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count, host="127.0.0.1", also_free_at_offset=None):
    """`count` distinct ports that were free a moment ago (held open together while picking).

    With `also_free_at_offset`, port + offset is checked free as well (tf_rdma's listener port).
    They are picked at random below the ephemeral range: between this check and the servers'
    binds, no connection any process makes can be given one of them (bind(0) ports can)."""
    low_ephemeral, _ = _ephemeral_ports()
    offset = also_free_at_offset or 0
    lowest, highest = max(1024, 1024 - offset), min(low_ephemeral, low_ephemeral - offset) - 1
    rng = random.SystemRandom()
    socks, ports, taken = [], [], set()
    try:
        for _ in range(200 * count):
            if len(ports) == count:
                break
            port = rng.randint(lowest, highest)
            wanted = [port] if also_free_at_offset is None else [port, port + offset]
            if taken.intersection(wanted):
                continue
            bound = []
            for p in wanted:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, p))
                except OSError:
                    s.close()
                    break
                bound.append(s)
            socks += bound
            if len(bound) == len(wanted):
                ports.append(port)
                taken.update(wanted)
        if len(ports) < count:
            raise RuntimeError(f"could not find {count} free ports on {host}")
        return ports
    finally:
        for s in socks:
            s.close()
