"""The impairments the Soft-RoCE fault cases put on the linked guests' link (issue 27): `tc netem`
on eth0's egress, in each guest, so both directions are impaired.

NETEM: 1% loss and 20 ms +- 5 ms of delay. `rate` keeps the packets in order, as a link does.
REORDERING: the same jitter without `rate`: netem then gives each packet its own delay, so packets
overtake each other and RC's go-back-N retransmission slows a message to a crawl (docs/faults.md,
"What they found")."""
import shutil
import subprocess

NETEM = ["loss", "1%", "delay", "20ms", "5ms", "rate", "1gbit"]
REORDERING = ["delay", "20ms", "5ms"]
TC = shutil.which("tc") or "/usr/sbin/tc"
DELETE = [TC, "qdisc", "del", "dev", "eth0", "root"]
LOAD = ["modprobe", "sch_netem"]  # the guests' Debian kernel has it (the host's does not)


def add(netem=NETEM):
    """The command that puts `netem` on eth0's egress."""
    return [TC, "qdisc", "replace", "dev", "eth0", "root", "netem", *netem]


def run(argv):
    """Runs one command of the above here, bounded; raises naming it if it fails."""
    done = subprocess.run(argv, timeout=30, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")


def impair_here(netem=NETEM):
    run(LOAD)
    run(add(netem))
