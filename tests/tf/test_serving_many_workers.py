"""A ps serving many workers (issue 26): its threads do not grow with the number of workers."""
import pytest

from tf_rdma import bench_scale


@pytest.mark.timeout(300)
@pytest.mark.stream_backends_only  # TensorFlow over verbs: the few guest tests in tests/softroce
def test_a_ps_serving_twelve_workers_runs_at_most_ten_threads_more_than_with_one(backend):
    """1 ps and 12 workers (servers of one process); a step with worker 0, then one with all 12,
    each checked exact: the ps's threads after each."""
    with_one, with_twelve = bench_scale.run_tf(backend, [1, 12], budget=0.1)
    assert with_twelve["ps_threads"] - with_one["ps_threads"] <= 10, (
        f"the ps ran {with_one['ps_threads']} threads serving one worker and {with_twelve['ps_threads']} "
        f"serving 12")
