"""`python -m tf_rdma bench data`: tf.data service elements read by a trainer over stock gRPC and
each tf_rdma backend, in one run, beside the machine's limits measured in the same run.

One dispatcher and 1-2 workers (each a process, every worker with tf_rdma's data transfer protocol
loaded) serve `from_tensors` datasets of one element size each, repeated from a cache so that the
workers spend nothing per element but sending it; then one trainer process per transport reads
each size in `parallel_epochs` mode (`compression=None`): stock gRPC (TensorFlow's own transfer,
from the same workers), then tf_rdma over each backend (TF_RDMA_BACKEND of the trainer, which
dials). Per size and transport: elements/s and GB/s over the timed elements (after a warm-up), and
the trainer's CPU time (user + system, every thread) per element; beside them a plain memcpy and a
plain TCP socket stream of the element's size between two processes (`bench transport`'s
baselines). Ratios are tf_rdma's elements/s over gRPC's. Each trainer counts the elements and bytes
that arrived and checks the first byte for byte; unless all arrived and the first is exact, the
bench fails (ElementsLost) instead of reporting figures.
"""
import itertools
import json
import resource
import sys
import tempfile
import time

from tf_rdma.bench._common import PEER_START_SECONDS, RESULT_PREFIX, line_within, ratios, start_task, task_result
from tf_rdma.bench.transport import limits
from tf_rdma.ports import free_ports
from tf_rdma.sizes import format_size
from tf_rdma.transport import available_backends

SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)
FULL = {"bytes_per_size": 2 << 30, "min_elements": 64, "max_elements": 4000, "warmup": 8,
        "limit_bytes_per_size": 1 << 30}
QUICK = {"bytes_per_size": 32 << 20, "min_elements": 6, "max_elements": 100, "warmup": 2,
         "limit_bytes_per_size": 16 << 20}


def elements_per_worker(size, params):
    return max(params["min_elements"], min(params["max_elements"], params["bytes_per_size"] // size))


def element_pattern(tf, size):
    """The bytes of every element of `size`: not zeros, so a lost or misplaced range shows."""
    return tf.cast(tf.range(size) % 251, tf.uint8)


def dataset(tf, size, count):
    # Made once on the worker and repeated from memory: the worker's cost per element is sending it.
    return tf.data.Dataset.range(1).map(lambda _: element_pattern(tf, size)).cache().repeat(count)


# ---- the processes of a bench (and of tests/tf/test_data_service.py) ----

def dispatcher(port, worker_timeout_ms=3000):
    import tensorflow as tf
    server = tf.data.experimental.service.DispatchServer(tf.data.experimental.service.DispatcherConfig(
        port=port, worker_timeout_ms=worker_timeout_ms))
    print("serving", flush=True)
    server.join()


def worker(dispatcher_port, protocol):
    """A worker serving `protocol` ("tf_rdma", or "grpc": TensorFlow alone, tf_rdma not imported)."""
    import tensorflow as tf
    options = {}
    if protocol == "tf_rdma":
        import tf_rdma
        options["data_transfer_protocol"] = tf_rdma.DATA_TRANSFER_PROTOCOL
    server = tf.data.experimental.service.WorkerServer(tf.data.experimental.service.WorkerConfig(
        dispatcher_address=f"localhost:{dispatcher_port}", heartbeat_interval_ms=500, **options))
    print("serving", flush=True)
    server.join()


def data_bytes_received():
    """tf.data elements' bytes this process received on tf_rdma, over all its servers."""
    from tf_rdma import server
    return sum(peer["bytes_received_by_kind"].get("data", 0)
               for record in server.stats_records() for peer in record["peers"].values())


def trainer(spec):
    """Reads every size of `spec["plan"]` over `spec["transport"]`; prints its figures on one line."""
    import numpy as np
    import tensorflow as tf
    options = {}
    if spec["transport"] != "grpc":
        import tf_rdma
        options["data_transfer_protocol"] = tf_rdma.DATA_TRANSFER_PROTOCOL
    service = f"grpc://localhost:{spec['dispatcher_port']}"
    rows = []
    for size, count in spec["plan"]:
        expected = element_pattern(tf, size).numpy()
        before = data_bytes_received() if options else 0
        elements = iter(dataset(tf, size, count).apply(tf.data.experimental.service.distribute(
            "parallel_epochs", service, job_name=None, compression=None, **options)))
        # Fewer elements than the warm-up's are counted too: the driver names what is missing.
        arrived = arrived_bytes = 0
        exact = False
        for element in itertools.islice(elements, spec["warmup"]):
            if arrived == 0:
                exact = element.dtype == tf.uint8 and np.array_equal(element.numpy(), expected)
            arrived_bytes += int(element.shape.num_elements())
            arrived += 1
        timed, timed_bytes = 0, 0
        cpu_before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for element in elements:
            timed_bytes += int(element.shape.num_elements())
            timed += 1
        seconds = time.perf_counter() - start
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        rows.append({"size": size, "elements": arrived + timed, "bytes": arrived_bytes + timed_bytes,
                     "first_exact": bool(exact), "timed_elements": timed, "seconds": seconds,
                     "cpu_seconds": cpu,
                     "tf_rdma_bytes": (data_bytes_received() - before) if options else 0})
    result = {"rows": rows}
    if options:
        result["fallback"] = tf_rdma.stats().get("fallback", {})
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _role(spec):
    if spec["role"] == "dispatcher":
        dispatcher(spec["port"])
    elif spec["role"] == "worker":
        worker(spec["dispatcher_port"], "tf_rdma")
    else:
        trainer(spec)


# ---- the bench ----

def _serve(spec, name, log):
    """Starts a dispatcher or worker process and waits until it serves; its stderr goes to `log`."""
    process = start_task("tf_rdma.bench.data", spec, stderr=log)
    line_within(process, "serving", PEER_START_SECONDS, f"bench data: the {name}", log)
    return process


def read_over(transport, dispatcher_port, plan, params, timeout=900):
    """A trainer's rows for `plan` ([[size, elements per worker]]) over `transport`."""
    process = start_task("tf_rdma.bench.data", {"role": "trainer", "transport": transport, "plan": plan,
                                                "dispatcher_port": dispatcher_port,
                                                "warmup": params["warmup"]})
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    return task_result(process, out, err, f"bench data over {transport}: the trainer")["rows"]


class ElementsLost(RuntimeError):
    """A trainer did not receive exactly the elements the workers made: its figures are void."""


def check_arrived(transport, rows, plan, workers, log=None):
    """Raises ElementsLost unless `rows` (a trainer's over `transport`) hold, per size of `plan`,
    every element of every worker (parallel_epochs: each worker sends the whole dataset), each of
    the size's bytes, the first byte-exact. `log`: the dispatcher's and workers' stderr, whose
    tail the error gives."""
    for row, (size, per_worker) in zip(rows, plan):
        expected = per_worker * workers
        if row["elements"] == expected and row["bytes"] == expected * size and row["first_exact"]:
            continue
        tail = ""
        if log is not None:
            log.seek(0)
            tail = f"\nthe dispatcher's and workers' log ends:\n{log.read()[-3000:]}"
        raise ElementsLost(
            f"bench data over {transport}, {format_size(size)} elements from {workers} worker(s): the trainer "
            f"received {row['elements']} elements, {row['bytes']} bytes in all, not {expected} "
            f"({per_worker} per worker), {expected * size} bytes; the first "
            f"{'byte-exact' if row['first_exact'] else 'NOT byte-exact'}. Elements were lost, repeated or "
            f"corrupted on the way, so no throughput is reported; the logs say which task failed.{tail}")


def combine(measured, carried, workers, plan, machine):
    """One row per size from each transport's trainer rows ({transport: rows}), with tf_rdma's
    elements/s over gRPC's, the trainer's CPU per element and the machine's limits for the size."""
    rows = []
    for i, (size, per_worker) in enumerate(plan):
        row = {"size": size, "elements": per_worker * workers}
        for transport in ["grpc", *carried]:
            got = measured[transport][i]
            row[f"{transport}_elements_per_second"] = got["timed_elements"] / got["seconds"]
            row[f"{transport}_gbps"] = got["timed_elements"] * size / got["seconds"] / 1e9
            row[f"{transport}_cpu_us_per_element"] = got["cpu_seconds"] / got["timed_elements"] * 1e6
            row[f"{transport}_arrived"] = {k: got[k] for k in ("elements", "bytes", "first_exact")}
            if transport != "grpc":
                row[f"{transport}_tf_rdma_bytes_share"] = got["tf_rdma_bytes"] / got["bytes"]
        for backend in carried:
            row[f"vs_grpc_{backend}"] = ratios(row[f"{backend}_elements_per_second"],
                                               row["grpc_elements_per_second"])
        row.update(machine[size])
        rows.append(row)
    return rows


def run(backends, workers=2, sizes=SIZES, quick=False, progress=None):
    """{"backends", "unavailable", "workers", "quick", "rows": [one per size]}"""
    params = QUICK if quick else FULL
    usable = available_backends()
    carried = [b for b in backends if usable.get(b) is None]
    report = {"backends": carried, "workers": workers, "quick": quick,
              "unavailable": {b: usable.get(b, "unknown backend") for b in backends if b not in carried}}
    plan = [[size, elements_per_worker(size, params)] for size in sizes]
    if progress:
        progress("machine limits (memcpy, TCP socket)")
    machine = limits(list(sizes), params["limit_bytes_per_size"])
    [dispatcher_port] = free_ports(1)
    processes = []
    with tempfile.TemporaryFile("w+") as log:
        try:
            processes.append(_serve({"role": "dispatcher", "transport": "grpc", "port": dispatcher_port},
                                    "dispatcher", log))
            for i in range(workers):
                processes.append(_serve({"role": "worker", "transport": "grpc", "dispatcher_port": dispatcher_port},
                                        f"worker {i}", log))
            measured = {}
            for transport in ["grpc", *carried]:
                if progress:
                    progress(f"{workers} worker(s) to a trainer over {transport}")
                measured[transport] = read_over(transport, dispatcher_port, plan, params)
                check_arrived(transport, measured[transport], plan, workers, log)
        finally:
            for process in processes:
                process.kill()
                process.wait()
    report["rows"] = combine(measured, carried, workers, plan, machine)
    return report


def render(report):
    backends = report["backends"]
    columns = ["grpc", *backends]
    lines = [f"{backend}: unavailable: {reason}" for backend, reason in report["unavailable"].items()]
    lines.append(f"tf.data service: {report['workers']} worker(s), one trainer, parallel_epochs, compression=None"
                 " (x = tf_rdma's elements/s over gRPC's)")

    def table(title, figure, scale, digits, ratios_too=False):
        lines.append(title)
        lines.append(f"  {'size':>8}" + "".join(f" {t:>9}" for t in columns)
                     + ("".join(f" {'x ' + b:>8}" for b in backends) if ratios_too else ""))
        for row in report["rows"]:
            line = f"  {format_size(row['size']):>8}" + "".join(
                f" {row[f'{t}_{figure}'] * scale:9.{digits}f}" for t in columns)
            if ratios_too:
                line += "".join(f" {row[f'vs_grpc_{b}']:8.2f}" for b in backends)
            lines.append(line)

    table("elements/s", "elements_per_second", 1, 0, ratios_too=True)
    table("GB/s (machine limits below)", "gbps", 1, 2)
    table("trainer CPU per element (us)", "cpu_us_per_element", 1, 1)
    lines.append("  machine limits, same run: " + ", ".join(
        f"{format_size(r['size'])} memcpy {r['memcpy_gbps']:.2f} socket {r['tcp_socket_gbps']:.2f} GB/s"
        for r in report["rows"]))
    return "\n".join(lines)


def plot(report, path):
    """Elements/s and GB/s over element sizes (log scales), the memcpy and socket limits drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report["rows"]
    labels = [format_size(r["size"]) for r in rows]
    figure, (rate, gbps) = plt.subplots(1, 2, figsize=(10, 4))
    for transport in ["grpc", *report["backends"]]:
        name = "gRPC" if transport == "grpc" else f"tf_rdma {transport}"
        rate.plot(labels, [r[f"{transport}_elements_per_second"] for r in rows], marker="o", label=name)
        gbps.plot(labels, [r[f"{transport}_gbps"] for r in rows], marker="o", label=name)
    gbps.plot(labels, [r["memcpy_gbps"] for r in rows], "k--", label="memcpy")
    gbps.plot(labels, [r["tcp_socket_gbps"] for r in rows], "k:", label="TCP socket")
    for ax, unit in ((rate, "elements/s"), (gbps, "GB/s")):
        ax.set_yscale("log")
        ax.set_xlabel("element size")
        ax.set_ylabel(f"{unit} (higher is better)")
        ax.legend(fontsize="small")
    figure.suptitle(f"tf.data service, {report['workers']} worker(s) to one trainer")
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    _role(json.loads(sys.argv[1]))
