"""Task programs for the fault tests: `python wire_programs.py FUNCTION JSON_ARGS`, as
tests/tf/programs/tasks.py (whose `serve` runs the ps). The worker is driven line by line on its stdin,
so the test applies and lifts faults between and during its steps, and answers with one JSON
object per line on stdout."""
import hashlib
import json
import sys
import time

import numpy as np

from tests.tf.programs.tasks import _server, classification_set, serve  # noqa: F401  (serve: the ps's program)

BATCH = 64


def _say(**fields):
    print(json.dumps(fields), flush=True)


def driven_worker(cluster, job, index, transport, op_timeout_ms, hidden=256, learning_rate=0.5):
    """A TF1 ps+worker model (variables on the ps, the step on the worker). Commands:

    init             sets the ps's variables to fixed values fed from here (reproducible, unlike
                     re-running an initializer; and a ps restarted empty gets them again)
    train N [P]      N steps from batch 0; with P, stops before step P, says "paused" and waits for
                     a line on stdin (the test applies its fault meanwhile). Says the digest of
                     every loss and the final variables, the seconds taken, or the first error
    renew            a new session (the old one abandoned, not closed: that could wait on a lost ps)
    probe            writes random values to the ps and reads them back: every byte must match
    exit

    Every step runs with RunOptions(timeout_in_ms=op_timeout_ms): whatever the transport does with
    a fault, the step ends by then."""
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    server = _server(cluster, job, index, transport)
    features, labels = classification_set()
    rng = np.random.default_rng(7)
    initial = {"w1": rng.standard_normal((64, hidden)).astype(np.float32) * 0.1,
               "w2": rng.standard_normal((hidden, 10)).astype(np.float32) * 0.1}
    with tf.device("/job:ps/task:0"):
        weights = {name: tf.compat.v1.Variable(value, name=name) for name, value in initial.items()}
    with tf.device("/job:worker/task:0"):
        images = tf.compat.v1.placeholder(tf.float32, (None, 64))
        targets = tf.compat.v1.placeholder(tf.int64, (None,))
        logits = tf.matmul(tf.nn.relu(tf.matmul(images, weights["w1"])), weights["w2"])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))
        train = tf.compat.v1.train.GradientDescentOptimizer(learning_rate).minimize(loss)
        fed = {name: tf.compat.v1.placeholder(tf.float32, v.shape) for name, v in initial.items()}
    with tf.device("/job:ps/task:0"):
        assign = [weights[name].assign(fed[name]) for name in initial]
    with tf.device("/job:worker/task:0"):
        read = {name: tf.identity(w) for name, w in weights.items()}
    options = tf.compat.v1.RunOptions(timeout_in_ms=op_timeout_ms)
    sess = tf.compat.v1.Session(server.target)

    def run(fetches, feed=None):
        return sess.run(fetches, feed, options=options)

    def failure(error, started):
        return {"error": type(error).__name__, "message": str(error)[:1500], "failed_at": time.time(),
                "seconds": time.monotonic() - started}

    batches = len(features) // BATCH
    _say(ready=True)
    for line in sys.stdin:
        command, *args = line.split()
        started = time.monotonic()
        try:
            if command == "init":
                run(assign, {fed[name]: value for name, value in initial.items()})
                _say(init=True)
            elif command == "train":
                steps, pause_at = int(args[0]), int(args[1]) if len(args) > 1 else None
                digest = hashlib.sha256()
                seconds = 0.0
                for step in range(steps):
                    if step == pause_at:
                        seconds += time.monotonic() - started
                        _say(paused=step)
                        sys.stdin.readline()
                        started = time.monotonic()
                    batch = slice(step % batches * BATCH, (step % batches + 1) * BATCH)
                    value, _ = run([loss, train], {images: features[batch], targets: labels[batch]})
                    digest.update(np.float32(value).tobytes())
                    _say(step=step)
                for name, value in sorted(run(read).items()):
                    digest.update(name.encode() + value.tobytes())
                _say(trained=steps, digest=digest.hexdigest(), seconds=seconds + time.monotonic() - started)
            elif command == "renew":
                sess = tf.compat.v1.Session(server.target)
                _say(renew=True)
            elif command == "probe":
                values = {name: rng.standard_normal(v.shape).astype(np.float32) for name, v in initial.items()}
                run(assign, {fed[name]: value for name, value in values.items()})
                back = run(read)
                _say(probe=all(np.array_equal(back[name], values[name]) for name in values),
                     seconds=time.monotonic() - started)
            elif command == "exit":
                break
        except tf.errors.OpError as e:
            _say(**failure(e, started))
    _say(exited=True)
    import os
    os._exit(0)  # closing the session would ask a vanished ps to deregister its graphs


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](arguments["cluster"], arguments["job"], arguments["index"], **arguments["kwargs"])
