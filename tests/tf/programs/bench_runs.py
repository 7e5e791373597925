"""Runs `python -m tf_rdma bench ...` as a user does, and checks a bench's table and plot, for the
bench tests."""
import json
import os
import subprocess
import sys

from tests import with_optional_packages


def bench_report(*arguments, timeout):
    """`python -m tf_rdma bench ARGUMENTS --json`, checked to exit 0: its report, and its stderr
    (where the progress lines go)."""
    env = with_optional_packages(os.environ) if "--plot" in arguments else None
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "bench", *arguments, "--json"],
                            capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), result.stderr


def check_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG image"


def check_table_and_plot(bench, report, lines, path):
    """`bench.render(report)` (a bench module's table) holds each of `lines`; `bench.plot` draws
    `report` to `path` with something in every panel."""
    import matplotlib.pyplot as plt
    text = bench.render(report)
    for line in lines:
        assert line in text, f"{line!r} is not in the table:\n{text}"
    bench.plot(report, path)
    check_png(path)
    figure = plt.gcf()  # the plot's, still open
    empty = [ax.get_title() or f"panel {i}" for i, ax in enumerate(figure.axes)
             if not (ax.lines or ax.patches or ax.collections)]
    plt.close(figure)
    assert not empty, f"panels with nothing drawn: {empty}"
