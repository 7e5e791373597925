"""A ps serving many workers (issue 26): its threads do not grow with the number of workers, and
workers that went quiet leave it no receive memory."""
import json
import os
import subprocess
import sys

import pytest

from tests.tf.programs.cluster import PROGRAMS
from tf_rdma.bench import scale as bench_scale


@pytest.mark.timeout(300)
@pytest.mark.stream_backends_only  # TensorFlow over verbs: the few guest tests in tests/softroce
def test_a_ps_serving_twelve_workers_runs_at_most_ten_threads_more_than_with_one(backend):
    """1 ps and 12 workers (servers of one process); a step with worker 0, then one with all 12,
    each checked exact: the ps's threads after each."""
    with_one, with_twelve = bench_scale.run_tf(backend, [1, 12], budget=0.1)
    assert with_twelve["ps_threads"] - with_one["ps_threads"] <= 10, (
        f"the ps ran {with_one['ps_threads']} threads serving one worker and {with_twelve['ps_threads']} "
        f"serving 12")


QUIET_WORKERS = PROGRAMS / "quiet_workers.py"
WORKERS, ELEMENTS = 3, 2 << 20  # each worker sends the ps 16 MiB (int64) once
SENT = 8 * ELEMENTS


@pytest.mark.timeout(240)
@pytest.mark.stream_backends_only
def test_a_ps_frees_the_receive_regions_of_workers_that_went_quiet(backend):
    """1 ps and 3 workers (servers of one process) with a short TF_RDMA_RECEIVE_POOL_IDLE_MS: each
    worker sends the ps 16 MiB once. Once they are quiet, the ps's receive regions are freed (and
    on shm unmapped by the workers too), so the process's memory falls by what they held; a later
    step from worker 0 gets a region again and is exact."""
    environment = {**os.environ, "TF_RDMA_BACKEND": backend, "TF_RDMA_RECEIVE_POOL_IDLE_MS": "3000",
                   "TF_CPP_MIN_LOG_LEVEL": "1"}
    ran = subprocess.run([sys.executable, str(QUIET_WORKERS), str(WORKERS), str(ELEMENTS), "60"],
                         capture_output=True, text=True, timeout=180, env=environment)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    outcome = json.loads(ran.stdout.strip().splitlines()[-1])
    triangle = ELEMENTS * (ELEMENTS - 1) // 2
    assert outcome["first"] == [(index + 1) * triangle for index in range(WORKERS)], outcome
    after_step, quiet, after_again = outcome["after_step"], outcome["quiet"], outcome["after_again"]
    assert after_step["region_bytes"] >= WORKERS * SENT, outcome
    assert quiet["region_bytes"] == 0, outcome
    if backend == "shm":
        # The ps's regions and the workers' maps of them. What stays is each connection's request
        # slots for worker-service calls (cc/tf/calls/): one region of 4 x 8 KiB per end, mapped
        # by both tasks, for at most the ps's connection to each worker and worker 0's (the
        # master's) to each other worker.
        assert after_step["shared"] >= 2 * WORKERS * SENT, outcome
        connections = WORKERS + (WORKERS - 1)
        assert quiet["shared"] <= connections * 2 * 2 * (4 * 8 << 10), outcome
    assert after_step["rss"] - quiet["rss"] >= WORKERS * SENT * 3 // 4, outcome
    assert outcome["again"] == triangle, outcome
    assert after_again["region_bytes"] >= SENT, outcome
