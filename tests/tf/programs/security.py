"""Programs for test_security.py: `python security.py FUNCTION JSON_ARGS`, as tasks.py."""
import json
import os
import sys
import time

import numpy as np


def steps_for(cluster, job, index, output, seconds):
    """TF1 worker: steps that read a ps variable, for `seconds` after the first ("warm"); records
    how many ran and the first error."""
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    server = tf_rdma.Server(cluster, job_name=job, task_index=index)
    with tf.device("/job:ps/task:0"):
        variable = tf.compat.v1.Variable(np.arange(1000, dtype=np.float32))
    with tf.device("/job:worker/task:0"):
        total = tf.reduce_sum(variable * 2.0)
    outcome = {"steps": 0, "error": None}
    with tf.compat.v1.Session(server.target) as session:
        session.run(variable.initializer)
        session.run(total)
        print("warm", flush=True)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                assert session.run(total) == 999000.0
                outcome["steps"] += 1
        except Exception as e:  # the outcome under test, whatever its class
            outcome["error"] = f"{type(e).__name__}: {e}"[:2000]
    with open(output, "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def push_and_pull(cluster, job, index, sizes):
    """TF1 worker: until killed, steps that add tensors of `sizes` float32s into this worker's own
    ps variables and read them back, so tensors cross both ways; prints "warm" after the first."""
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    server = tf_rdma.Server(cluster, job_name=job, task_index=index)
    with tf.device("/job:ps/task:0"):
        # float64: float32 sums of millions of elements stop being exact within a few hundred steps
        variables = [tf.compat.v1.Variable(tf.zeros([n], tf.float64), name=f"w{index}_{n}") for n in sizes]
    with tf.device(f"/job:{job}/task:{index}"):
        updates = [v.assign_add(tf.ones([n], tf.float64)) for v, n in zip(variables, sizes)]
        with tf.control_dependencies(updates):
            totals = [tf.reduce_sum(v.read_value()) for v in variables]
    with tf.compat.v1.Session(server.target) as session:
        session.run([v.initializer for v in variables])
        step = 0
        while True:
            step += 1
            got, want = session.run(totals), [float(step * n) for n in sizes]
            assert got == want, f"step {step}: read back {got}, expected {want}"
            if step == 3:
                print("warm", flush=True)


def hostile_worker(cluster, job, index):
    """A worker task whose TensorFlow is plain gRPC (the master runs its partitions) and whose
    tf_rdma listener is a key holder written from the wire format (tests/transport/wire_client.py):
    it answers every header grant the ps makes it with a malformed tensor header, and gives back
    the grants the ps revokes. Prints "serving"; runs until killed."""
    import socket
    import struct
    import threading
    import tensorflow as tf
    from tests.transport import wire_client as w
    from tf_rdma.config import load_config
    config = load_config()
    server = tf.distribute.Server(cluster, job_name=job, task_index=index)
    name = f"/job:{job}/replica:0/task:{index}"
    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind(("localhost", int(cluster[job][index].rsplit(":", 1)[1]) + config.port_offset))
    listening.listen(8)

    def serve(sock):
        peer = w.RawPeer.accepted("tcp", sock)
        peer.sock.settimeout(None)
        kind, hello = peer.receive()
        _, _, their_nonce, their_name, _ = w.parse_greeting(hello)
        our_nonce = os.urandom(32)
        peer.send(w.frame(w.CHALLENGE, w.greeting(w.PROTOCOL_VERSION, "tcp", our_nonce, name)))
        kind, _ = peer.receive()
        peer.send(w.frame(w.ACCEPT, w.token(config.cluster_key(), "responder->initiator", "tcp", their_name,
                                            name, their_nonce, our_nonce)))
        while True:
            kind, body = peer.receive()
            if kind == w.GRANT:
                grant_id, _, tag_lo, _, _, capacity = struct.unpack("<QQQIQQ", body)
                if tag_lo % 2 == 0 and capacity >= 32:  # a header's grant: fill it with junk
                    peer.send(w.data(grant_id, 32) + b"\xee" * 32)
            elif kind == w.REVOKE:
                peer.send(w.revoked(struct.unpack("<Q", body)[0]))

    print("serving", flush=True)
    while True:
        threading.Thread(target=serve, args=(listening.accept()[0],), daemon=True).start()


def receive_bad_headers(cluster, job, index, output, steps):
    """TF1 ps and client: `steps` steps that receive a 400 KB tensor from the (hostile) worker;
    records each step's error and then the receive pools' usage."""
    import tensorflow as tf
    import tf_rdma
    tf.compat.v1.disable_eager_execution()
    server = tf_rdma.Server(cluster, job_name=job, task_index=index)
    with tf.device("/job:worker/task:0"):
        sent = tf.random.uniform([100_000])
    with tf.device("/job:ps/task:0"):
        total = tf.reduce_sum(sent)
    errors = []
    with tf.compat.v1.Session(server.target) as session:
        for _ in range(steps):
            try:
                session.run(total)
                errors.append(None)
            except Exception as e:  # the outcome under test, whatever its class
                errors.append(f"{type(e).__name__}: {e}"[:500])
    time.sleep(1)  # the revoked grants' answers
    with open(output, "w") as f:
        json.dump({"errors": errors, "stats": tf_rdma.stats()}, f)
    os._exit(0)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
