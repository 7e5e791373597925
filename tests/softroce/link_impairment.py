"""The impairments the Soft-RoCE fault cases put on the linked guests' link: `tc netem`
on eth0's egress, in each guest, so both directions are impaired; and partitions, nftables drops at
one guest's end of the link, both ways.

NETEM: 1% loss, 1% duplication and 20 ms +- 5 ms of delay. `rate` keeps the packets in order, as a
link does.
REORDERING: the same jitter without `rate`: netem then gives each packet its own delay, so packets
overtake each other and RC's go-back-N retransmission slows a message to a crawl (docs/faults.md,
"How verbs behaves under these faults")."""
import shutil
import subprocess
import time

NETEM = ["loss", "1%", "duplicate", "1%", "delay", "20ms", "5ms", "rate", "1gbit"]
REORDERING = ["delay", "20ms", "5ms"]
LINK = "eth0"  # tools/softroce/guest.py LINK_NETDEV: the linked guests' NIC
TC = shutil.which("tc") or "/usr/sbin/tc"
DELETE = [TC, "qdisc", "del", "dev", LINK, "root"]
LOAD = ["modprobe", "sch_netem"]  # the guests' Debian kernel has it (the host's does not)


def add(netem=NETEM):
    """The command that puts `netem` on eth0's egress."""
    return [TC, "qdisc", "replace", "dev", LINK, "root", "netem", *netem]


def run(argv):
    """Runs one command of the above here, bounded; raises naming it if it fails."""
    done = subprocess.run(argv, timeout=30, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")


def impair_here(netem=NETEM):
    run(LOAD)
    run(add(netem))


NFT = shutil.which("nft") or "/usr/sbin/nft"
PARTITION_TABLE = "tf_rdma_partition"
ROCE_V2 = "udp dport 4791"  # RoCE v2's packets, rdma_cm's included
EVERYTHING = ""


class Partition:
    """Drops the link's packets that match `what` both ways at this guest's end (nftables input and
    output hooks on eth0): none crosses, and none is answered by an error packet (no ICMP, no RST).
    ROCE_V2 leaves TCP through (the transport suite's control channel to its peer agent); EVERYTHING
    cuts TensorFlow's gRPC too. The link heals on leaving the block."""

    def __init__(self, what=ROCE_V2):
        self.what = what

    def __enter__(self):
        script = [f"add table inet {PARTITION_TABLE}"]
        for hook, interface in (("input", "iifname"), ("output", "oifname")):
            script.append(f"add chain inet {PARTITION_TABLE} {hook} {{ type filter hook {hook} priority 0; }}")
            script.append(f'add rule inet {PARTITION_TABLE} {hook} {interface} "{LINK}" {self.what} drop')
        done = subprocess.run([NFT, "-f", "-"], input="\n".join(script) + "\n", timeout=30,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nft could not partition {LINK} ({self.what or 'everything'}): {done.stderr.strip()}")
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc):
        run([NFT, "delete", "table", "inet", PARTITION_TABLE])
