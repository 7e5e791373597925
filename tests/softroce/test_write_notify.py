"""tools/bench/write_notify (`make bench-notify`), the measurement behind the verbs backend's choice
of WRITE_WITH_IMM over a polled trailing flag: it builds, and a short run over a real kernel RDMA
stack (natively, or in the Soft-RoCE guest) moves and checks every message in all three modes."""
import json
import os
import re
import subprocess

from tests.softroce.guest_loader import REPO

SOURCE = REPO / "tools" / "bench" / "write_notify.cc"


def test_write_notify_measures_all_three_modes(on_rdma):
    # In the repo's build/, which the guest sees as the host has it.
    binary = REPO / "build" / "write_notify-test"
    binary.parent.mkdir(exist_ok=True)
    build = subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-o", str(binary),
                            str(SOURCE), "-lrdmacm", "-libverbs"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr

    host = os.environ.get("TFRDMA_TEST_HOST", "10.77.0.1")  # an address of the RDMA netdev
    returncode, output = on_rdma([str(binary), "--ip", host, "--json", "--sizes", "8,64K",
                                  "--scale", "0.02", "--rounds", "1"], timeout=240)
    assert returncode == 0, output
    start = re.search(r"^\{", output, re.M)
    assert start, output
    report = json.loads(output[start.start():output.rindex("}") + 1])
    rows = {(row["size"], row["mode"]): row for row in report["rows"]}
    assert set(rows) == {(size, mode) for size in (8, 64 << 10) for mode in ("imm+event", "imm+poll", "flag+poll")}
    for row in rows.values():
        assert row["latency_us_median"] > 0 and row["throughput_MBps"] > 0, row
