"""Worker- and eager-service calls between tf_rdma tasks (cc/tf/calls/): once a TF1 session ran its
first steps, or a TF2 coordinator its first scheduled functions, none of them needs gRPC. Proved by
dropping every packet of TensorFlow's own ports between the hosts: the next steps still run, each a
RunGraph call, or eager calls, on tf_rdma. And they keep gRPC's semantics: a closed session cancels
its steps on the remote task."""
import json
import subprocess
import time

import pytest

from tests.harness import netns
from tests.tf.programs.cluster import Cluster, NamespacedCluster

NO_NAMESPACES = netns.unavailable_reason("the tasks run on hosts of their own (network namespaces)")
PS = "/job:ps/replica:0/task:0"
WORKER = "/job:worker/replica:0/task:0"


def run_on_with_tensorflows_ports_blocked(cluster, net, job, process, output, warm_timeout):
    """Once `job`'s task 0 (`process`) prints "warm", drops every packet of every task's TensorFlow
    port, tells the task, and returns the outcome it saves once it ran on."""
    cluster.wait_for_output(job, 0, "warm", timeout=warm_timeout)
    for addresses in cluster.spec.values():
        for address in addresses:
            net.block_port(int(address.rsplit(":", 1)[1]))
    process.stdin.write(b"blocked\n")
    process.stdin.flush()
    assert cluster.wait(job, 0, timeout=120) == 0, cluster.log(job, 0)[-3000:]
    with open(output) as f:
        return json.load(f)


@pytest.mark.skipif(NO_NAMESPACES is not None, reason=NO_NAMESPACES or "")
def test_steps_run_on_with_tensorflows_ports_blocked_after_the_first(tmp_path):
    output = str(tmp_path / "outcome.json")
    steps = 100
    with netns.Network() as net, \
            NamespacedCluster(tmp_path, net, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": "tcp"}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        worker = cluster.start("worker", 0, "steps_with_grpc_blocked_worker", transport="rdma", output=output,
                               steps=steps, stdin=subprocess.PIPE)
        outcome = run_on_with_tensorflows_ports_blocked(cluster, net, "worker", worker, output, warm_timeout=120)
    assert outcome["counter"] == 2 * steps, outcome
    calls = outcome["stats"]["peers"][PS]["calls_made"]
    # A step's partition on the ps runs by one RunGraph call; its cleanup goes in a CleanupGraphs
    # call, with the other steps' of the same millisecond (the session's close waited for them all).
    assert calls["RunGraph"] >= 2 * steps and "CleanupGraph" not in calls, calls
    assert 1 <= calls["CleanupGraphs"] <= calls["RunGraph"], calls
    # Only device discovery, before the session, stayed on gRPC.
    on_grpc = outcome["stats"]["peers"][PS]["calls_on_grpc"]
    assert set(on_grpc) == {"GetStatus"} and on_grpc["GetStatus"] <= 2, on_grpc
    assert not outcome["stats"]["fallback"], outcome["stats"]


@pytest.mark.skipif(NO_NAMESPACES is not None, reason=NO_NAMESPACES or "")
def test_a_coordinators_scheduled_steps_run_on_with_tensorflows_ports_blocked(tmp_path):
    """TF2 ParameterServerStrategy: the coordinator's contexts, its functions' dispatch and
    results, and the worker's component functions on the ps are eager-service calls on tf_rdma."""
    output = str(tmp_path / "outcome.json")
    steps = 30
    with netns.Network() as net, NamespacedCluster(tmp_path, net, {"chief": 1, "ps": 1, "worker": 1},
                                                   {"TF_RDMA_BACKEND": "tcp"}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        cluster.start("worker", 0, "serve", transport="rdma")
        chief = cluster.start("chief", 0, "coordinator_steps_with_grpc_blocked", transport="rdma", output=output,
                              steps=steps, stdin=subprocess.PIPE)
        outcome = run_on_with_tensorflows_ports_blocked(cluster, net, "chief", chief, output, warm_timeout=180)
    assert outcome["counter"] == 2 * steps, outcome
    assert len(outcome["losses"]) == 2 * steps, outcome
    for task in (PS, WORKER):
        calls = outcome["stats"]["peers"][task]["calls_made"]
        # A context on each task, and the scheduled functions enqueued on the worker.
        assert calls["CreateContext"] == 1, (task, calls)
        # Only device discovery, before the contexts, stayed on gRPC.
        on_grpc = outcome["stats"]["peers"][task]["calls_on_grpc"]
        assert set(on_grpc) <= {"GetStatus"}, (task, on_grpc)
    worker_calls = outcome["stats"]["peers"][WORKER]["calls_made"]
    assert worker_calls.get("StreamingEnqueue", 0) + worker_calls.get("Enqueue", 0) >= 2 * steps, worker_calls
    assert not outcome["stats"]["fallback"], outcome["stats"]


def test_eager_calls_on_a_context_a_client_without_tf_rdma_made_reach_grpcs_eager_service(tmp_path):
    """The worker's component-function calls to the ps travel on tf_rdma, but the context they
    name was created over gRPC: the ps's tf_rdma service passes them to its gRPC eager service,
    counting each, and the steps run."""
    output = str(tmp_path / "outcome.json")
    ps_stats = str(tmp_path / "ps-stats.json")
    steps = 10
    with Cluster(tmp_path, {"chief": 1, "ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": "tcp"}) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma", stats_file=ps_stats)
        cluster.start("worker", 0, "serve", transport="rdma")
        cluster.start("chief", 0, "coordinator_without_tf_rdma", transport="grpc", output=output, steps=steps)
        assert cluster.wait("chief", 0, timeout=180) == 0, cluster.log("chief", 0)[-3000:] + cluster.log("worker", 0)[-3000:]
        on_ps = cluster.stats_dumped_after(ps_stats, time.time())
    with open(output) as f:
        assert json.load(f) == {"joined": True}
    served = on_ps["peers"][WORKER]["calls_served"]
    assert served.get("RunComponentFunction", 0) >= steps, served
    forwarded = on_ps["fallback"].get("an eager-service call on a context gRPC's eager service holds", 0)
    assert forwarded >= served["RunComponentFunction"], on_ps["fallback"]


@pytest.mark.parametrize("transport", [("grpc", None), ("rdma", "tcp"), ("rdma", "shm")], ids=lambda t: t[1] or t[0])
def test_a_closed_session_cancels_its_step_on_the_ps(tmp_path, transport):
    """As gRPC does: closing the session cancels its running step's RunGraph call, and the ps's
    part of the step (a dequeue from an empty queue) ends with it; a new session's element then
    reaches the new session's dequeue, not a step of the closed one still waiting on the ps."""
    name, backend = transport
    output = str(tmp_path / "outcome.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": backend or "auto"}) as cluster:
        cluster.start("ps", 0, "serve", transport=name)
        cluster.start("worker", 0, "closed_session_worker", transport=name, output=output)
        assert cluster.wait("worker", 0, timeout=120) == 0, cluster.log("worker", 0)[-3000:]
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["warm"] == 2.0, outcome
    assert outcome["step_ended"] and outcome["blocked_step"] == "CancelledError", outcome
    assert outcome["ended_after_close_s"] < 5, outcome
    assert outcome["new_session_got"] == 3.0, outcome
    if name == "rdma":
        calls = outcome["stats"]["peers"][PS]["calls_made"]
        assert calls["RunGraph"] >= 3 and calls.get("DeleteWorkerSession", 0) >= 1, calls
        assert set(outcome["stats"]["peers"][PS]["calls_on_grpc"]) <= {"GetStatus"}, outcome["stats"]
        assert not outcome["stats"]["fallback"], outcome["stats"]
