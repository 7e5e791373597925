"""`python -m tests.harness soak`: a short real soak over tcp and shm that must stay flat, and the
flatness judgement and table on canned samples (a leak, a transient, too short a run)."""
import json
import subprocess
import sys

import pytest

from tests import REPO
from tests.harness import flatness, soak

MINIMUM_TRANSFERS_AFTER_WARMUP = 10_000
MINUTES = 0.6
# A loaded host spends more of a run restarting the peer, and the soak then runs on, up to
# soak.MOST_SECONDS_FACTOR times its time, for the samples flatness needs; each backend's cluster
# takes up to a minute more to start and stop there. The test waits for that.
LONGEST_SECONDS = 2 * (MINUTES * 60 * soak.MOST_SECONDS_FACTOR + 60)


@pytest.mark.timeout(LONGEST_SECONDS + 20)
def test_a_short_soak_over_tcp_and_shm_stays_flat_through_cancelled_steps_and_a_restarted_peer():
    command = [sys.executable, "-m", "tests.harness", "soak", "--minutes", str(MINUTES), "--backend", "tcp,shm",
               "--json"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=LONGEST_SECONDS, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        # What it wrote so far: bytes, as subprocess collects it before it decodes.
        progress = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"the soak ran past {LONGEST_SECONDS:.0f} s; its progress:\n{progress[-4000:]}")
    assert result.stdout, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["backends"] == ["tcp", "shm"] and report["unavailable"] == {}
    for run in report["runs"]:
        at_warmup, end = run["samples"][run["warmup_samples"]], run["samples"][-1]
        # What happened after warm-up, where flatness is judged: real traffic, cancelled steps
        # and a restarted peer the worker recovered from.
        assert end["tensors"] - at_warmup["tensors"] >= MINIMUM_TRANSFERS_AFTER_WARMUP, run["backend"]
        assert end["cancelled_steps"] > at_warmup["cancelled_steps"], run["backend"]
        assert end["restarts"] > at_warmup["restarts"], run["backend"]
        assert end["sessions"] > at_warmup["sessions"], run["backend"]
        grew = {f"{process} {quantity}": q for process, quantities in run["flatness"].items()
                for quantity, q in quantities.items() if not q["flat"]}
        assert not grew, (run["backend"], grew)
    assert report["flat"] and result.returncode == 0, result.stderr[-3000:]
    assert "soak over tcp" in result.stderr and "soak over shm" in result.stderr  # the progress lines


def sample(seconds, worker_rss_mib, worker_fds=20, ps_threads=100):
    quantities = {"rss_bytes": 600 << 20, "fds": 20, "threads": 100, "region_bytes": 64 << 20,
                  "mapped_shm_bytes": 192 << 20, "live_steps": 3}
    return {"seconds": seconds, "steps": seconds * 100, "tensors": seconds * 2500,
            "worker": {**quantities, "rss_bytes": worker_rss_mib << 20, "fds": worker_fds},
            "ps": {**quantities, "threads": ps_threads}}


def judged(samples):
    """The soak's judgement of `samples`, the first 4 of them warm-up."""
    return flatness.judge(samples, 4, soak.GROWTH_BOUNDS, soak.PROCESSES)


def test_a_process_that_keeps_growing_after_warmup_is_not_flat():
    samples = [sample(s, 600 + 2 * s) for s in range(12)]  # 2 MiB a second
    verdict = judged(samples)
    rss = verdict["worker"]["rss_bytes"]
    assert rss["baseline"] == 608 << 20 and rss["end"] == 618 << 20 and not rss["flat"]
    assert verdict["ps"]["rss_bytes"]["flat"]


def test_a_descriptor_left_open_after_warmup_is_not_flat_but_one_open_for_a_moment_is():
    leaked = [sample(s, 600, worker_fds=20 if s < 8 else 21) for s in range(12)]
    assert not judged(leaked)["worker"]["fds"]["flat"]
    # A thread or descriptor alive during one sample (a handshake, a step) is not a leak.
    transient = [sample(s, 600, ps_threads=101 if s in (5, 10) else 100) for s in range(12)]
    assert judged(transient)["ps"]["threads"]["flat"]


def test_a_run_whose_restarts_took_its_time_goes_on_until_flatness_has_its_samples():
    def run(seconds, first_restart_at):
        return [{**sample(s, 600), "sessions": 1 if s < first_restart_at else 2} for s in range(seconds + 1)]
    assert soak.run_is_over(run(12, first_restart_at=4), 12)  # 9 samples after warm-up
    # Warm-up ends with the first restart, at 10 s: 3 samples after it at 12 s, too few to judge.
    assert not soak.run_is_over(run(12, first_restart_at=10), 12)
    assert soak.run_is_over(run(15, first_restart_at=10), 12)
    # A run that never gets there ends all the same, and judge says to run longer.
    assert not soak.run_is_over(run(35, first_restart_at=40), 12)
    assert soak.run_is_over(run(36, first_restart_at=40), 12)


def test_too_few_samples_after_warmup_is_an_error_not_a_pass():
    with pytest.raises(flatness.TooFewSamples, match="run longer"):
        judged([sample(s, 600) for s in range(8)])


def test_the_table_marks_warmup_and_what_grew():
    samples = [{**sample(s, 600 + 2 * s), "cancelled_steps": s, "restarts": s // 4, "sessions": 1 + s // 4}
               for s in range(12)]
    verdict = judged(samples)
    run = {"backend": "shm", "seconds": 12, "steps": 1100, "cancelled_steps": 11, "failed_steps": 2,
           "restarts": 2, "tensors": 27500, "bytes": 3 << 30, "tensors_after_warmup": 17500,
           "warmup_samples": 4, "samples": samples, "flatness": verdict, "flat": False}
    text = soak.render({"unavailable": {"verbs": "no RDMA device"}, "runs": [run], "flat": False})
    assert "verbs: unavailable: no RDMA device" in text
    assert "*     4     400     10000 |    608.0 MiB   20  100" in text
    assert "worker rss_bytes            608.0 MiB ->    618.0 MiB  growth   10.0 MiB (bound 8.0 MiB): GREW" in text
    assert text.endswith("NOT FLAT: something grew after warm-up")
