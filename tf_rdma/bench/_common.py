"""What the benches share: their helper processes' lines read within a deadline, endpoints, and for
the TensorFlow benches (and the tests' soak and chaos harness), clusters of tasks on this host, each
task a process of its own (`python -m MODULE SPEC_JSON`) that reports on a result line, and the
timing and ratios of their figures."""
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from tf_rdma import config
from tf_rdma.ports import free_ports

# Starts the line on which a task prints its figures (as JSON): whatever else it prints is not read.
RESULT_PREFIX = "@@result "
# The longest a bench's helper process (a peer, a spinner) may take to start: seconds as a rule,
# minutes on a loaded or emulated host.
PEER_START_SECONDS = 300


def line_within(process, prefix, seconds, who, log=None, needed=None):
    """The rest of the first line of `process`'s stdout that starts with `prefix` (lines before it
    are skipped), read within `seconds`. If none comes, the process is killed and the error names
    `who`, whether it exited or fell silent, and the tail of its stderr: `log` (the file it
    writes to), else its stderr pipe. `needed`: (process, name) of a peer it waits on, whose exit
    ends the wait at once, named."""
    found = []

    def read():  # in a thread: a pipe's readline takes no deadline
        for line in process.stdout:
            if line.startswith(prefix):
                found.append(line[len(prefix):])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + seconds
    while reader.is_alive() and time.monotonic() < deadline:
        reader.join(min(1.0, max(0.0, deadline - time.monotonic())))
        if needed is not None and reader.is_alive() and needed[0].poll() is not None:
            process.kill()
            process.wait()
            raise RuntimeError(f"{who}: {needed[1]} exited with code {needed[0].returncode} while it waited")
    if found:
        return found[0]
    exited = not reader.is_alive()
    process.kill()
    code = process.wait()
    if log is not None:
        log.flush()
        log.seek(0)
        tail = log.read()[-3000:]
    elif process.stderr is not None:
        tail = process.stderr.read()[-3000:]
    else:
        tail = "(it writes to this process's stderr: see above)"
    wanted = f"a line starting {prefix.strip()!r}" if prefix else "a line"
    why = (f"it exited with code {code} before writing {wanted}" if exited
           else f"it wrote no {wanted[2:]} within {seconds:.0f} s, so it was killed")
    raise RuntimeError(f"{who}: {why}; its log ends:\n{tail}")


def endpoint(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def timed(run, budget, warmup=3, min_steps=5, max_steps=2000):
    """Median seconds of `run()` over as many calls as fit `budget`, after `warmup` calls."""
    for _ in range(warmup):
        run()
    times, deadline = [], time.perf_counter() + budget
    while len(times) < min_steps or (time.perf_counter() < deadline and len(times) < max_steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def ratios(grpc_seconds, seconds):
    return grpc_seconds / seconds if seconds > 0 else None


def start_server(spec):
    """The server of task `spec["job"]`:`spec["index"]` of `spec["cluster"]`, over stock gRPC or tf_rdma
    (`spec["transport"]`)."""
    import tensorflow as tf
    cluster = tf.train.ClusterSpec(spec["cluster"])
    if spec["transport"] == "grpc":
        return tf.distribute.Server(cluster, job_name=spec["job"], task_index=spec["index"])
    import tf_rdma
    return tf_rdma.Server(cluster, job_name=spec["job"], task_index=spec["index"])


def coordinated_strategy(spec):
    """(strategy, ClusterCoordinator) of the chief of `spec["cluster"]`: TensorFlow's
    ParameterServerStrategy over stock gRPC, or tf_rdma's (`spec["transport"]`)."""
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec["cluster"]), task_type="chief", task_id=0, rpc_layer="grpc")
    if spec["transport"] == "grpc":
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    else:
        import tf_rdma
        strategy = tf_rdma.ParameterServerStrategy(resolver)
    return strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def open_session(server):
    """A TF1 session on `server` with grappler off, so that every transport runs the same graph."""
    import tensorflow as tf
    session_config = tf.compat.v1.ConfigProto()
    session_config.graph_options.rewrite_options.disable_meta_optimizer = True
    return tf.compat.v1.Session(server.target, config=session_config)


def local_cluster(jobs):
    """A cluster spec of `jobs` ({"ps": 1, "worker": 2}) on free ports of this host, each with its
    tf_rdma port (+ TF_RDMA_PORT_OFFSET) free too."""
    ports = iter(free_ports(sum(jobs.values()), also_free_at_offset=config.port_offset))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(count)] for job, count in jobs.items()}


def start_task(module, spec, stderr=subprocess.PIPE, env=None, prefix=(), stdin=None):
    """`python -m module SPEC_JSON`: one task of a bench cluster in its own process, on tf_rdma's
    `spec["transport"]` backend (or stock gRPC), its result lines on a pipe; `env` adds variables
    (TF_CPP_MIN_LOG_LEVEL too, 2 unless given); `prefix` runs it elsewhere (e.g. `ip netns exec
    NAMESPACE`, which keeps the process's id)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if spec["transport"] != "grpc":
        env["TF_RDMA_BACKEND"] = spec["transport"]
    return subprocess.Popen([*prefix, sys.executable, "-m", module, json.dumps(spec)],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def task_result(process, out, err, who):
    """What a finished bench task printed on its result line. Raises naming `who` if it failed, or
    if anything it moved stayed on gRPC (its "fallback")."""
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"{who} failed ({process.returncode}):\n{err[-3000:]}")
    result = json.loads(lines[0][len(RESULT_PREFIX):])
    if result.get("fallback"):
        raise RuntimeError(f"{who}: transfers stayed on gRPC: {result['fallback']}")
    return result
