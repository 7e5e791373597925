"""Runs one workload, its whole cluster, inside a fresh network namespace and counts the bytes that
crossed its loopback interface: in a namespace of its own, the loopback carries this run's TCP and
nothing else. With TF_RDMA_BACKEND=shm tf_rdma itself moves no byte over TCP (memfd regions and a
Unix socket), so every loopback byte of an rdma run is TensorFlow's gRPC; in a grpc run they are
all of it, tensors included.

    measure(name, transport, out_dir) -> {"loopback_bytes", "loopback_packets", "grpc_bytes",
                                          "tensor_bytes_rdma", "digest", "stats", ...}

`python -m tests.tf.coverage.netns inside JSON` (from the repository's root) is the part that runs
inside the namespace.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests import REPO
from tests.harness import netns as namespaces


# Header bytes the loopback counts per packet around the TCP payload: 20 IPv4 + 32 TCP (with the
# timestamps option Linux sends by default). Not the 66 of an Ethernet capture: lo counts a packet
# after eth_type_trans() pulled its 14-byte Ethernet header (measured in a fresh namespace: 200
# 10-byte messages with TCP_NODELAY counted 12,504 bytes in 202 packets, 2,000 + 202 x 52).
# Approximate: SYNs carry 8 option bytes more, and an IPv6 packet (gRPC may pick ::1 for
# "localhost") 20 more, which this leaves in the gRPC count (an overestimate, never an
# underestimate); a GSO packet of up to 64 KiB counts its headers once, as it is counted once.
HEADER_BYTES_PER_PACKET = 52


def unavailable_reason():
    """Why this machine cannot measure, or None (only not being root; see tests.harness.netns)."""
    return namespaces.unavailable_reason("each run gets its own network namespace (unshare -n)")


def check_tools():
    namespaces.check_tools(("unshare", "ip"), "the coverage tests, which run every cluster in its own "
                                              "network namespace,")


def loopback_counters():
    """(tx bytes, tx packets) of `lo` in this process's network namespace. Read from
    /proc/net/dev, which follows the reader's namespace; /sys/class/net/lo/statistics shows the
    namespace that mounted /sys (the host's), so it cannot be used from inside `unshare -n`."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                values = [int(v) for v in fields.split()]
                return values[8], values[9]       # transmit bytes, packets
    raise RuntimeError("no lo in /proc/net/dev")


def _tensor_bytes(stats):
    """Tensor bytes tf_rdma carried: what each task sent, summed over its peers and the tasks.
    Takes tf_rdma.stats() ({"peers": {task: {...}}}) or cluster_utils.rdma_stats_summary()."""
    total = 0
    for task_stats in stats.values():
        if "peers" in task_stats:
            total += sum(int(p.get("bytes_sent", 0)) for p in task_stats["peers"].values())
        else:
            total += int(task_stats.get("bytes_sent", 0))
    return total


def _inside(name, transport, out_dir):
    """In the fresh namespace: bring lo up, count, run the workload, count again."""
    from tests.tf.coverage.workloads import WORKLOADS
    from tests.tf.programs.cluster import digest
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    before = loopback_counters()
    t0 = time.monotonic()
    measurement = {"workload": name, "transport": transport,
                   "backend": os.environ.get("TF_RDMA_BACKEND")}
    try:
        run = WORKLOADS[name].run(transport, Path(out_dir))
    except BaseException as e:                 # reported by the caller, with the logs' tails
        measurement["error"] = f"{type(e).__name__}: {e}"
    else:
        measurement.update(digest=digest(run["results"]), stats=run["stats"],
                           tensor_bytes_rdma=_tensor_bytes(run["stats"]))
    after = loopback_counters()
    measurement["seconds"] = time.monotonic() - t0
    measurement["loopback_bytes"] = after[0] - before[0]
    measurement["loopback_packets"] = after[1] - before[1]
    measurement["grpc_bytes"] = max(0, measurement["loopback_bytes"]
                                    - HEADER_BYTES_PER_PACKET * measurement["loopback_packets"])
    with open(Path(out_dir) / "measurement.json", "w") as f:
        json.dump(measurement, f, indent=1)


def measure(name, transport, out_dir, backend="shm", timeout=900):
    """Runs workload `name` over `transport` in a fresh network namespace; the measurement."""
    check_tools()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if transport == "rdma":
        env["TF_RDMA_BACKEND"] = backend
    argv = ["unshare", "-n", "--", sys.executable, "-m", "tests.tf.coverage.netns", "inside",
            json.dumps([name, transport, str(out_dir)])]
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)
    path = out_dir / "measurement.json"
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"measuring {name} over {transport} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(path) as f:
        return json.load(f)


def share(measurement):
    """tf_rdma's share of the run's cross-task bytes."""
    tensor, grpc = measurement.get("tensor_bytes_rdma", 0), measurement["grpc_bytes"]
    return tensor / (tensor + grpc) if tensor + grpc else 0.0


if __name__ == "__main__":
    assert sys.argv[1] == "inside", sys.argv
    _inside(*json.loads(sys.argv[2]))
