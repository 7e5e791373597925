"""`python -m tf_rdma bench transport`: each backend against the baselines of the same run.

The receiver runs in a second process (`python -m tf_rdma bench-peer`), so the figures include
everything two real processes pay. Baselines, measured between the same two processes in the same
run: a plain single-stream TCP socket moving the same bytes, and a plain memcpy of the same size.
"""
import secrets
import subprocess
import sys

from tf_rdma import _transport
from tf_rdma.transport import available_backends

DEFAULT_SIZES = (4 << 20, 64 << 20)
DEFAULT_LATENCY_SIZES = (8, 4096)


def plan(sizes, latency_sizes, bytes_per_size, round_trips):
    p = _transport.BenchPlan()
    p.sizes = list(sizes)
    p.latency_sizes = list(latency_sizes)
    p.bytes_per_size = bytes_per_size
    p.latency_round_trips = round_trips
    return p


def _plan_args(sizes, latency_sizes, bytes_per_size, round_trips):
    return ["--sizes", ",".join(map(str, sizes)), "--latency-sizes", ",".join(map(str, latency_sizes)),
            "--bytes-per-size", str(bytes_per_size), "--round-trips", str(round_trips)]


def serve(backend, sizes, latency_sizes, bytes_per_size, round_trips):
    """The bench peer: prints its ports on one line, then serves one driver."""
    key = sys.stdin.readline().strip()  # the driver's one-off cluster key; never on the command line

    def ready(transport_port, baseline_port):
        print(f"READY {transport_port} {baseline_port}", flush=True)

    _transport.bench_serve(backend, plan(sizes, latency_sizes, bytes_per_size, round_trips), 0,
                           bytes.fromhex(key).decode("latin-1"), ready)


def run_backend(backend, sizes, latency_sizes, bytes_per_size, round_trips):
    key = secrets.token_hex(16)
    peer = subprocess.Popen(
        [sys.executable, "-m", "tf_rdma", "bench-peer", "--backend", backend,
         *_plan_args(sizes, latency_sizes, bytes_per_size, round_trips)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        peer.stdin.write(key + "\n")
        peer.stdin.close()
        line = peer.stdout.readline().split()
        if len(line) != 3 or line[0] != "READY":
            raise RuntimeError(f"bench peer for {backend} did not start (exit code {peer.poll()})")
        report = _transport.bench_drive(
            backend, plan(sizes, latency_sizes, bytes_per_size, round_trips),
            f"127.0.0.1:{line[1]}", f"127.0.0.1:{line[2]}", bytes.fromhex(key).decode("latin-1"))
        peer.wait(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait()
    for row in report["throughput"]:
        row["vs_tcp_socket"] = row["transport_gbps"] / row["tcp_socket_gbps"]
        row["vs_memcpy"] = row["transport_gbps"] / row["memcpy_gbps"]
    for row in report["latency"]:
        row["vs_tcp_socket"] = row["transport_us"] / row["tcp_socket_us"]
    return report


def run(backends, sizes=DEFAULT_SIZES, latency_sizes=DEFAULT_LATENCY_SIZES,
        bytes_per_size=1 << 30, round_trips=500):
    usable = available_backends()
    results = {}
    for backend in backends:
        if usable[backend] is not None:
            results[backend] = {"unavailable": usable[backend]}
            continue
        results[backend] = run_backend(backend, sizes, latency_sizes, bytes_per_size, round_trips)
    return results


def _size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def render(results):
    lines = []
    for backend, report in results.items():
        if "unavailable" in report:
            lines.append(f"{backend}: unavailable: {report['unavailable']}")
            continue
        lines.append(f"{backend}: throughput (GB/s), same run, same two processes")
        lines.append(f"  {'size':>8} {'tf_rdma':>8} {'tcp sock':>9} {'memcpy':>8} {'vs sock':>8} {'vs memcpy':>9}")
        for r in report["throughput"]:
            lines.append(f"  {_size(r['size']):>8} {r['transport_gbps']:8.2f} {r['tcp_socket_gbps']:9.2f} "
                         f"{r['memcpy_gbps']:8.2f} {r['vs_tcp_socket']:8.2f} {r['vs_memcpy']:9.2f}")
        lines.append(f"{backend}: one-way latency (us)")
        for r in report["latency"]:
            lines.append(f"  {_size(r['size']):>8} {r['transport_us']:8.1f} vs tcp socket "
                         f"{r['tcp_socket_us']:.1f} (ratio {r['vs_tcp_socket']:.2f})")
    return "\n".join(lines)
