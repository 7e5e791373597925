"""What a holder of the cluster key can and cannot do to a running tf_rdma cluster."""
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from tests.tf.programs.cluster import PROGRAMS, Cluster
from tf_rdma import _transport, errors
from tf_rdma.config import load_config

PROGRAM = PROGRAMS / "security.py"


def test_a_key_holder_cannot_take_over_a_live_tasks_connection(tmp_path):
    """An impersonator claiming the ps's name to the worker, while the ps is connected, is refused
    in its handshake ("not now", retried until its connect timeout); the worker's steps go on over
    the real ps's connection."""
    output = str(tmp_path / "steps.json")
    with Cluster(tmp_path, {"ps": 1, "worker": 1}) as cluster:
        cluster.start("ps", 0, "serve")
        cluster.start("worker", 0, "steps_for", program=PROGRAM, output=output, seconds=6)
        cluster.wait_for_output("worker", 0, "warm", timeout=120)
        key = load_config().cluster_key()  # what every task derives from TF_RDMA_SECRET
        impostor = _transport.Transport("tcp", name="/job:ps/replica:0/task:0", cluster_key=key, connect_timeout=2.0)
        host, port = cluster.spec["worker"][0].split(":")
        with pytest.raises(errors.PeerUnavailableError,
                           match="does not admit /job:ps/replica:0/task:0: its connection with task "
                                 "/job:ps/replica:0/task:0 is alive still"):
            impostor.connect(f"{host}:{int(port) + load_config().port_offset}")
        assert cluster.wait("worker", 0, timeout=60) == 0, cluster.log("worker", 0)[-3000:]
        assert "told a dial claiming to be task /job:ps/replica:0/task:0 to wait" in cluster.log("worker", 0)
    with open(output) as f:
        outcome = json.load(f)
    assert outcome["error"] is None and outcome["steps"] > 10, outcome


def shared_memory_mapped_by(process):
    """The tf_rdma shm regions `process` maps, by inode: its own and those its peers shared with it."""
    with open(f"/proc/{process.pid}/maps") as f:
        return {int(m.group(1)) for m in re.finditer(r" (\d+) +/memfd:tf_rdma-region", f.read())}


def test_a_peer_can_write_only_into_memory_that_holds_its_own_tensors(tmp_path):
    """Over shm a peer maps the regions it is granted, read-write. Each peer's grants come from
    regions of its own, so no memory is shared with two peers; and once a peer's connection ends
    (it restarted), the regions it could write leave the ps."""
    sizes = [1000, 300_000, 3_000_000]  # inline, slab and dedicated-region sized tensors
    with Cluster(tmp_path, {"ps": 1, "worker": 2}, env={"TF_RDMA_BACKEND": "shm"}) as cluster:
        ps = cluster.start("ps", 0, "serve")
        workers = [cluster.start("worker", i, "push_and_pull", program=PROGRAM, sizes=sizes) for i in (0, 1)]
        for i in (0, 1):
            cluster.wait_for_output("worker", i, "warm", timeout=180)
        with_ps = [shared_memory_mapped_by(ps) & shared_memory_mapped_by(w) for w in workers]
        assert with_ps[0] and with_ps[1], "both workers must share regions with the ps"
        assert not with_ps[0] & with_ps[1], "a region of the ps is shared with both workers"

        cluster.signal("worker", 0, 9)
        cluster.wait("worker", 0, timeout=30)
        cluster.start("worker", 0, "push_and_pull", program=PROGRAM, sizes=sizes)
        cluster.wait_for_output("worker", 0, "warm", timeout=180)
        deadline = time.monotonic() + 30
        while shared_memory_mapped_by(ps) & with_ps[0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not shared_memory_mapped_by(ps) & with_ps[0], "the dead worker's regions stayed in the ps"
        assert workers[1].poll() is None, cluster.log("worker", 1)[-3000:]  # its steps read back exact sums


def test_bad_tensor_headers_from_a_key_holder_leave_no_receive_buffer_lent(tmp_path):
    """Each step the hostile worker answers the ps's header grant with a malformed header: the
    step fails naming the worker, and the data grant made for the tensor (planned 400 KB) is
    taken back, its pool buffer with it, instead of staying lent until the connection closes."""
    output = str(tmp_path / "outcome.json")
    steps = 8
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, env={"TF_RDMA_BACKEND": "tcp"}) as cluster:
        cluster.start("worker", 0, "hostile_worker", program=PROGRAM)
        cluster.wait_for_output("worker", 0, "serving", timeout=120)
        cluster.start("ps", 0, "receive_bad_headers", program=PROGRAM, output=output, steps=steps)
        assert cluster.wait("ps", 0, timeout=180) == 0, cluster.log("ps", 0)[-3000:]
    with open(output) as f:
        outcome = json.load(f)
    assert all(error and "/job:worker/replica:0/task:0" in error for error in outcome["errors"]), outcome["errors"]
    pool = outcome["stats"]["receive_pools"]["tcp"]
    assert pool["region_bytes"] > 0, pool  # the grants were made
    assert pool["buffers_in_use"] == 0 and pool["bytes_in_use"] == 0, pool


# A Python whose hashlib and ssl do not use OpenSSL (here they are blocked; otherwise importing
# TensorFlow loads libcrypto through them, bound before TensorFlow's library arrives) loads no
# libcrypto before TensorFlow: tf_rdma's is then the first, loaded after BoringSSL's functions
# of the same names entered the global scope.
GLOBAL_TENSORFLOW_FIRST = textwrap.dedent('''
    import os, sys
    sys.modules["_hashlib"] = sys.modules["_ssl"] = None
    sys.setdlopenflags(os.RTLD_GLOBAL | os.RTLD_NOW)
    import tensorflow
    import tf_rdma
    from tf_rdma import _transport, server  # the TensorFlow side too
    key = tf_rdma.load_config({"TF_RDMA_SECRET": sys.argv[1]}).cluster_key()
    listener = _transport.Transport("tcp", name="ps", cluster_key=key).listen("127.0.0.1:0")
    to_ps = _transport.Transport("tcp", name="worker", cluster_key=key).connect(listener.endpoint)
    print("connected to", to_ps.peer_name, "accepted", listener.accept(10).peer_name, flush=True)
    stranger = _transport.Transport("tcp", name="stranger", cluster_key=_transport.cluster_key(b"x" * 64))
    try:
        stranger.connect(listener.endpoint)
    except tf_rdma.HandshakeError as error:
        print("refused:", "cluster key mismatch" in str(error), flush=True)
''')


def test_a_process_that_loaded_tensorflow_globally_first_runs_secret_checked_handshakes():
    """TensorFlow loaded RTLD_GLOBAL before tf_rdma (as some launchers and custom-op loaders do)
    puts BoringSSL's HMAC, EVP_sha256, ... in the global scope; tf_rdma's libcrypto must still run
    its own, or its handshake crashes the process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    secret = subprocess.run([sys.executable, "-m", "tf_rdma", "secret"], env=env, capture_output=True, text=True,
                            timeout=60, check=True).stdout.strip()
    result = subprocess.run([sys.executable, "-c", GLOBAL_TENSORFLOW_FIRST, secret], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit status {result.returncode}: {result.stderr[-3000:]}"
    # With ssl blocked, a library TensorFlow imports prints a traceback and "Continuing without ssl
    # support" to stdout first: the program's own lines are the last two.
    assert result.stdout.splitlines()[-2:] == ["connected to ps accepted worker", "refused: True"], result.stdout
