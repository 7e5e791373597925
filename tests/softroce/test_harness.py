"""Tests of the Soft-RoCE guest harness (tools/softroce/guest.py), run for real in qemu.

Skipped when the host packages are missing, unless CI is set: then they fail, so that a CI
machine without the harness's packages cannot pass silently.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.softroce.guest_loader import GUEST_PY, guest


def _qemu_pids_for(job_dir: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if job_dir.encode() in cmdline:
            pids.append(int(entry))
    return pids


def test_probes_without_booting():
    assert isinstance(guest.native_rdma_available(), bool)
    missing = guest.missing_prerequisites()
    assert isinstance(missing, list)
    assert all("install.sh" in m for m in missing)


def test_rxe0_is_active_in_guest(softroce):
    res = softroce.run(
        ["sh", "-c", "ibv_devinfo -d rxe0; rdma link show; "
                     "cat /sys/class/infiniband/rxe0/ports/1/gids/1; "
                     "echo memlock=$(ulimit -l)"],
        timeout=60)
    assert res.returncode == 0, res.output
    assert "PORT_ACTIVE" in res.output
    assert re.search(r"link rxe0/1 state ACTIVE .*netdev dummy0", res.output), res.output
    # GID index 1 is the RoCE v2 GID ::ffff:10.77.0.1
    assert "0000:0000:0000:0000:0000:ffff:0a4d:0001" in res.output
    assert "memlock=unlimited" in res.output
    assert 0 < res.boot_seconds < 120
    assert res.kernel and not os.path.exists(res.job_dir)


def test_exit_code_output_env_cwd_memlock(softroce, monkeypatch):
    monkeypatch.setenv("SOFTROCE_HOST_ONLY", "leak")  # the host env must not reach the guest
    res = softroce.run(
        ["sh", "-c", 'echo "out $GREETING"; echo "err line" >&2; pwd; '
                     'echo "leak=${SOFTROCE_HOST_ONLY:-none}"; echo "memlock=$(ulimit -l)"; '
                     'echo "path=$PATH"; exit 3'],
        timeout=60, env={"GREETING": "hello world"}, cwd="/usr/share", memlock="2048")
    assert res.returncode == 3, res.output
    assert not res.timed_out
    lines = res.output.splitlines()
    assert "out hello world" in lines
    assert "err line" in lines  # stderr is merged
    assert "/usr/share" in lines
    assert "leak=none" in lines
    assert "memlock=2048" in lines
    assert any(l.startswith("path=") and "/usr/bin" in l for l in lines)


def test_timeout_kills_guest(softroce):
    t0 = time.monotonic()
    res = softroce.run(["sleep", "1000"], timeout=4)
    wall = time.monotonic() - t0
    assert res.timed_out
    assert res.returncode == guest.TIMEOUT_EXIT_CODE == 124
    assert 4 <= res.run_seconds < 10, res
    assert wall < res.boot_seconds + 15, (wall, res)
    assert _qemu_pids_for(res.job_dir) == []
    assert not os.path.exists(res.job_dir)


def test_cli_timeout_message(monkeypatch, capsys):
    def fake_run(cmd, timeout, **kw):
        return guest.GuestResult(returncode=124, output="", boot_seconds=1.0,
                                 run_seconds=timeout, total_seconds=timeout + 1,
                                 timed_out=True, kernel="k", console="", job_dir="/nonexistent")
    monkeypatch.setattr(guest, "run", fake_run)
    rc = guest.main(["run", "--timeout", "3", "--", "sleep", "1000"])
    assert rc == 124
    assert "TIMEOUT" in capsys.readouterr().err


# Above the sum of this test's own waits, so they fail first, with the tasks' logs.
@pytest.mark.timeout(400)
def test_two_guests_concurrently_cli_and_api(softroce, tmp_path):
    """The CLI (exit code, env, cwd, host files visible) and an API run, side by side."""
    (tmp_path / "marker.txt").write_text("from the host\n")  # the guest sees the host's /
    results = {}

    def cli():
        results["cli"] = subprocess.run(
            [sys.executable, str(GUEST_PY), "run", "--timeout", "60", "--env", "FOO=bar=baz",
             "--cwd", str(tmp_path), "--", "sh", "-c",
             'cat marker.txt; echo "FOO=$FOO"; echo "cwd=$(pwd)"; exit 3'],
            capture_output=True, text=True, timeout=300)

    def api():
        results["api"] = softroce.run(["sh", "-c", "sleep 1; echo token-api"], timeout=60)

    threads = [threading.Thread(target=cli), threading.Thread(target=api)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(320)
    assert set(results) == {"cli", "api"}
    proc = results["cli"]
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["from the host", "FOO=bar=baz", f"cwd={tmp_path}"]
    assert "exit 3" in proc.stderr  # the CLI's timing line goes to stderr
    res = results["api"]
    assert res.returncode == 0, res.output
    assert res.output.strip() == "token-api"


PERFTEST = r"""
set -u
run_pair() {  # $@: extra ib_write_bw flags
    ib_write_bw -d rxe0 -x 1 -s 65536 -n 200 -F "$@" > /tmp/server.log 2>&1 &
    srv=$!
    ok=1
    for i in $(seq 60); do  # the server needs a moment to listen
        if ib_write_bw -d rxe0 -x 1 -s 65536 -n 200 -F "$@" 10.77.0.1; then ok=0; break; fi
        sleep 0.25
    done
    wait $srv; src=$?
    echo "server rc=$src"
    [ $ok -eq 0 ] && [ $src -eq 0 ]
}
echo "== ib_write_bw (TCP exchange)"; run_pair || exit 1
echo "== ib_write_bw -R (rdma_cm)"; run_pair -R || exit 2
"""


def test_perftest_ib_write_bw(softroce):
    out = io.BytesIO()
    res = softroce.run(["bash", "-c", PERFTEST], timeout=90, stream=out)
    assert res.returncode == 0, res.output
    assert out.getvalue().decode() == res.output
    # " 65536      200      19.66      18.38      0.000294"
    rows = re.findall(r"^\s*65536\s+200\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s*$", res.output, re.M)
    assert len(rows) == 2, res.output
    assert all(float(avg) > 0 for _, avg in rows)
    assert "rdma_cm QPs\t : ON" in res.output


def test_setup_failure_reports_console_tail(softroce, monkeypatch):
    monkeypatch.setattr(guest, "GUEST_IP", "300.1.1.1")  # `ip addr add` fails in the guest
    with pytest.raises(guest.GuestError) as exc:
        softroce.run(["true"], timeout=30)
    text = str(exc.value)
    assert "setup failed" in text
    assert "tail of the guest console" in text
    assert "softroce-stage2: FAILED: ip addr add" in text


LINKED_A = r"""
ip -4 -o addr show eth0; rdma link show
rping -s -a 10.78.0.1 -C 3 -v || exit 1
exit 3
"""
LINKED_B = r"""
ip -4 -o addr show eth0; rdma link show
for i in $(seq 60); do rping -c -a 10.78.0.1 -C 3 -v && break; sleep 0.5; done
while [ ! -e "$SOFTROCE_SHARED/guest-a.exit" ]; do sleep 0.2; done
echo "guest-a exited $(cat "$SOFTROCE_SHARED/guest-a.exit")"
sleep 1000
"""


# Above the sum of this test's own waits, so they fail first, with the guests' output.
@pytest.mark.timeout(400)
def test_linked_guests_talk_rdma_over_their_link_and_coordinate(softroce):
    """Two guests, rxe0 on each one's eth0, guest-a with a second device: rping (rdma_cm, RC)
    between them; guest-b learns guest-a's exit code through the shared directory, and is killed
    `linger` seconds after guest-a ended, its result a timeout."""
    a, b = softroce.run_linked(softroce.LinkedCommand(["bash", "-c", LINKED_A]),
                               softroce.LinkedCommand(["bash", "-c", LINKED_B]),
                               timeout=240, linger=5, second_rdma_device=True)
    report = f"--- guest-a ---\n{a.output}\n--- guest-b ---\n{b.output}"
    assert a.returncode == 3 and not a.timed_out, report
    assert "inet 10.78.0.1/24" in a.output and "inet 10.78.0.2/24" in b.output, report
    assert re.search(r"link rxe0/1 state ACTIVE .*netdev eth0", a.output), report
    assert re.search(r"link rxe1/1 state ACTIVE .*netdev dummy0", a.output), report
    assert "rxe1" not in b.output, report  # the second device is guest-a's alone
    assert a.output.count("server ping data: rdma-ping-") == 3, report
    assert b.output.count("ping data: rdma-ping-") == 3, report
    assert "guest-a exited 3" in b.output, report
    assert b.timed_out and b.returncode == guest.TIMEOUT_EXIT_CODE, report
    assert b.total_seconds < a.total_seconds + 30, (a, b)  # killed after the linger, not the timeout
    assert not os.path.exists(a.job_dir) and not os.path.exists(b.job_dir)
