"""Runs `python -m tf_rdma bench ...` as a user does, for the bench tests."""
import json
import subprocess
import sys


def bench_report(*arguments, timeout):
    """`python -m tf_rdma bench ARGUMENTS --json`, checked to exit 0: its report, and its stderr
    (where the progress lines go)."""
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "bench", *arguments, "--json"],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), result.stderr
