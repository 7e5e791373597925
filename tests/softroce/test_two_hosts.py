"""Verbs between two hosts: two linked Soft-RoCE guests (tools/softroce/guest.py run_linked), each
with its own kernel and rxe0 on its own virtual NIC, joined by a virtual Ethernet link. guest-a also
has a second RDMA device, rxe1, which cannot reach guest-b: the device must be chosen per peer.

- The transport suite's cases whose peer is another process (marked peer_process), with that
  process on guest-b, plus which device guest-a uses for guest-b (device_choice_across_hosts.py)
  and verbs connections across the link under loss, delay and partitions
  (verbs_faults_across_hosts.py).
- A TF1 session with the ps on guest-a and the worker on guest-b, over gRPC and over tf_rdma with
  TF_RDMA_BACKEND=auto: bit-identical results, and auto chose verbs for the peer on the other host;
  a step caught by a partition longer than the peer timeout fails over tf_rdma within it, naming
  the ps; once healed, the training again, through a short partition, gives the same results with
  no error and no new connection; then again with the link impaired (1% loss, 1% duplication, 20 +- 5 ms): the
  same results, and the step rates.

Skipped when the harness's host packages are missing, unless CI is set: then it fails
(tests/softroce/conftest.py).
"""
import json
import re

import pytest

from tests.softroce import tf_across_hosts
from tests.softroce.guest_loader import PYTHON, REPO, guest

AGENT_PORT = 7700


def linked(softroce, a_cmd, a_env, b_cmd, b_env, timeout):
    a, b = softroce.run_linked(
        softroce.LinkedCommand(a_cmd, env=a_env, cwd=str(REPO)),
        softroce.LinkedCommand(b_cmd, env=b_env, cwd=str(REPO)),
        timeout=timeout, second_rdma_device=True)
    report = (f"--- guest-a (exit {a.returncode}, boot {a.boot_seconds} s, ran {a.run_seconds} s) ---\n"
              f"{a.output[-8000:]}\n--- guest-b (exit {b.returncode}, boot {b.boot_seconds} s, ran "
              f"{b.run_seconds} s) ---\n{b.output[-5000:]}")
    print(report)  # timings in the log of a passing run too (pytest -s / -rP)
    return a, b, report


# Above the sum of this test's own waits, so they fail first, with the guests' output.
@pytest.mark.timeout(700)
def test_transport_peer_cases_and_device_choice_across_two_hosts(softroce):
    peer_ip = guest.LINK_IPS[1]
    a, b, report = linked(
        softroce,
        [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--backends", "verbs",
         "-m", "peer_process", "tests/transport/test_transport.py",
         "tests/softroce/device_choice_across_hosts.py", "tests/softroce/verbs_faults_across_hosts.py"],
        {"TFRDMA_TEST_HOST": guest.LINK_IPS[0], "TRANSPORT_TEST_PEER_AGENT": f"{peer_ip}:{AGENT_PORT}"},
        [PYTHON, "-m", "tests.transport.remote_process", "serve", peer_ip, str(AGENT_PORT),
         "--until", f"{guest.SHARED_MOUNT}/guest-a.exit"], {},
        timeout=600)
    summary = a.output.strip().splitlines()[-1] if a.output.strip() else ""
    assert a.returncode == 0, report
    assert re.search(r"\d+ passed", summary), report
    assert not re.search(r"failed|skipped|error", summary), report
    assert b.returncode == 0, report  # the agent served until guest-a was done


# Above the sum of this test's own waits, so they fail first, with the guests' output.
@pytest.mark.timeout(700)
def test_tf1_session_ps_and_worker_on_two_hosts_auto_chooses_verbs_bit_identical_to_grpc_through_partitions_and_loss(softroce):
    ps_ip, worker_ip = guest.LINK_IPS
    script = "tests.softroce.tf_across_hosts"
    env = {"TF_RDMA_BACKEND": "auto", "TF_CPP_MIN_LOG_LEVEL": "1",
           "TF_RDMA_PEER_TIMEOUT_MS": str(tf_across_hosts.PEER_TIMEOUT_MS)}
    a, b, report = linked(softroce, [PYTHON, "-m", script, "ps", ps_ip, worker_ip], env,
                          [PYTHON, "-m", script, "worker", ps_ip, worker_ip], env, timeout=600)
    assert b.returncode == 0 and a.returncode == 0, report

    def result(output):
        return json.loads(next(l for l in output.splitlines() if l.startswith("RESULT "))[len("RESULT "):])

    worker = result(b.output)
    digests, rates = worker["digests"], worker["steps_per_second"]
    # After a long partition, through a short one, and under 1% loss and 20 +- 5 ms of delay: no
    # step lost, changed or repeated on either.
    assert len(set(digests.values())) == 1 and len(digests) == 6, report
    print(f"steps/s: {rates}; under the impairment tf_rdma/gRPC = "
          f"{rates['rdma_impaired'] / rates['grpc_impaired']:.2f}")
    long_partition, short_partition = worker["long_partition"], worker["short_partition"]
    print(f"a step caught by a {tf_across_hosts.LONG_PARTITION_S:.0f} s partition: {long_partition}")
    print(f"a step through a {tf_across_hosts.SHORT_PARTITION_S:.0f} s partition: "
          f"gRPC {short_partition['grpc']['step_s']:.2f} s, tf_rdma {short_partition['rdma']['step_s']:.2f} s")
    caught = long_partition["rdma"]
    assert caught["error"] == "UnavailableError" and "/job:ps/replica:0/task:0" in caught["message"], report
    assert caught["failed_after_s"] < tf_across_hosts.PEER_TIMEOUT_MS / 1000 + tf_across_hosts.LONG_PARTITION_SLACK_S, report
    # The short partition: the connection carried on, and no error was counted against the ps.
    before, after = short_partition["rdma"]["peer_before"], short_partition["rdma"]["peer_after"]
    assert (after["connects"], after["errors"]) == (before["connects"], before["errors"]), short_partition
    peer = worker["stats"]["peers"]["/job:ps/replica:0/task:0"]
    assert peer["backend"] == "verbs", peer
    assert peer["tensors_received"] > 0 and peer["tensors_sent"] > 0 and peer["dead_tensors"] > 0, peer
    # The ps connects to the worker (the task with the smaller name does), so auto chose there.
    ps = result(a.output)["peers"]["/job:worker/replica:0/task:0"]
    assert (ps["backend"], ps["backend_reason"]) == ("verbs", "an RDMA device reaches the peer"), ps
    assert ps["tensors_sent"] > 0 and ps["tensors_received"] > 0, ps
