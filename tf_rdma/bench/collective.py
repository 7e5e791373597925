"""`python -m tf_rdma bench collective`: MultiWorkerMirroredStrategy all-reduce, stock gRPC against
each tf_rdma backend, in one run.

For each transport and worker count, a cluster of worker processes on this host runs TensorFlow's
own all-reduce (a ring, as the strategy picks on CPU) of a float32 vector of each size: a few
warm-up all-reduces, then as many timed ones as fit a time budget (at least `min_iterations`).
Each figure is worker 0's median time per all-reduce. Alongside, as the machine's limit for moving
those bytes: a plain memcpy of the same size, timed in the same run. Ratios are gRPC's time over
tf_rdma's (higher is better).
"""
import json
import os
import statistics
import sys
import time

from tf_rdma.bench._common import RESULT_PREFIX, local_cluster, ratios, start_task
from tf_rdma.sizes import format_size
from tf_rdma.transport import available_backends

DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20, 64 << 20)
DEFAULT_WORKERS = (2, 3)


def memcpy_seconds(size, budget=0.3):
    """Median time of a plain memcpy (libc's, as the transport's) of `size` bytes between two
    preallocated, already touched buffers."""
    import ctypes
    source, target = ctypes.create_string_buffer(b"\1" * size, size), ctypes.create_string_buffer(size)
    ctypes.memmove(target, source, size)
    times, deadline = [], time.perf_counter() + budget
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        ctypes.memmove(target, source, size)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(spec):
    """One worker of a bench cluster (run by `run_cluster` in its own process)."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": spec["addresses"]},
                                          "task": {"type": "worker", "index": spec["index"]}})
    import tensorflow as tf
    if spec["transport"] == "grpc":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import tf_rdma
        strategy = tf_rdma.MultiWorkerMirroredStrategy()
    results = []
    for size in spec["sizes"]:
        values = tf.ones([size // 4], tf.float32)

        @tf.function
        def all_reduce():
            return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, values))
        for _ in range(3):
            all_reduce().numpy()
        times = []
        # Every worker must run the same number of all-reduces: each proposes one from its timing of
        # a warm-up, and all take the mean of the proposals.
        start = time.perf_counter()
        all_reduce().numpy()
        first = time.perf_counter() - start
        proposal = max(spec["min_iterations"], min(200, int(spec["budget"] / max(first, 1e-6))))
        total = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.constant(float(proposal))))
        count = int(float(total.numpy()) / len(spec["addresses"]))
        for _ in range(count):
            start = time.perf_counter()
            all_reduce().numpy()
            times.append(time.perf_counter() - start)
        results.append({"size": size, "seconds": statistics.median(times), "iterations": count})
    if spec["index"] == 0:
        print(RESULT_PREFIX + json.dumps(results), flush=True)
    os._exit(0)  # the strategy's threads would otherwise keep the process alive


def run_cluster(transport, workers, sizes, budget, min_iterations, timeout=600):
    """[{size, seconds, iterations}] measured by worker 0 of a fresh cluster."""
    addresses = local_cluster({"worker": workers})["worker"]
    processes = [start_task("tf_rdma.bench.collective",
                            {"addresses": addresses, "index": index, "transport": transport, "sizes": list(sizes),
                             "budget": budget, "min_iterations": min_iterations})
                 for index in range(workers)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, (out, err) in zip(processes, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{transport} all-reduce worker failed ({p.returncode}):\n{err[-3000:]}")
    for line in outputs[0][0].splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"{transport} all-reduce worker 0 reported nothing:\n{outputs[0][1][-3000:]}")


def run(backends, sizes=DEFAULT_SIZES, worker_counts=DEFAULT_WORKERS, budget=1.0, min_iterations=3,
        progress=None):
    """{"rows": [{workers, size, memcpy_seconds, grpc_seconds, <backend>_seconds, vs_grpc_<backend>}],
    "unavailable": {backend: reason}}"""
    usable = available_backends()
    carried = [b for b in backends if usable.get(b) is None]
    report = {"unavailable": {b: usable.get(b, "unknown backend") for b in backends if b not in carried},
              "rows": []}
    memcpy = {size: memcpy_seconds(size) for size in sizes}
    for workers in worker_counts:
        measured = {}
        for transport in ["grpc", *carried]:
            if progress:
                progress(f"all-reduce, {workers} workers, {transport}")
            measured[transport] = {r["size"]: r for r in run_cluster(transport, workers, sizes, budget,
                                                                       min_iterations)}
        for size in sizes:
            row = {"workers": workers, "size": size, "memcpy_seconds": memcpy[size],
                   "grpc_seconds": measured["grpc"][size]["seconds"]}
            for backend in carried:
                row[f"{backend}_seconds"] = measured[backend][size]["seconds"]
                row[f"vs_grpc_{backend}"] = ratios(row["grpc_seconds"], row[f"{backend}_seconds"])
            report["rows"].append(row)
    return report


def render(report):
    lines = [f"{backend}: unavailable: {reason}" for backend, reason in report["unavailable"].items()]
    rows = report["rows"]
    if not rows:
        return "\n".join(lines)
    backends = [k[:-len("_seconds")] for k in rows[0] if k.endswith("_seconds")
                and k not in ("memcpy_seconds", "grpc_seconds")]
    lines.append("all-reduce (ms per all-reduce, worker 0's median; x = gRPC's time / tf_rdma's); memcpy "
                 "of the same bytes for the machine's limit")
    header = f"  {'workers':>7} {'size':>8} {'memcpy':>8} {'gRPC':>8}"
    for backend in backends:
        header += f" {backend:>8} {'x':>6}"
    lines.append(header)
    for r in rows:
        line = (f"  {r['workers']:>7} {format_size(r['size']):>8} {r['memcpy_seconds'] * 1e3:8.3f} "
                f"{r['grpc_seconds'] * 1e3:8.2f}")
        for backend in backends:
            line += f" {r[f'{backend}_seconds'] * 1e3:8.2f} {r[f'vs_grpc_{backend}']:6.2f}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
