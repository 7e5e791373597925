"""`python -m tf_rdma bench scale`: what serving many peers costs one process.

Transport level, per backend and per N (`--peers`): one receiver in a process of its own, N peers
in the bench's process connecting to it all at once (from 64 threads; peers of distinct names, as
many connections per name as TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME allows). Measured: the time
until all N connected; the receiver's threads, descriptors, RSS, virtual memory and shared memory
mapped, before any peer, with the N peers connected and idle, and after traffic (per peer: the
growth over N); then every peer writes FLOW_SIZE messages as fast as the receiver grants them
(SteadyFlow: both sides driven by the transport's own threads) for a few seconds: aggregate GB/s
and fairness, the bytes of the peer that moved least over those of the one that moved most. Beside
it, the machine's limits for the same message size in the same run (a memcpy, a plain TCP socket
stream between two processes: `bench transport`'s baselines).

TensorFlow level, over stock gRPC and each backend: 1 ps and W workers (`--workers`, the largest W
as servers of one process, so a dozen workers cost one TensorFlow import); steps in which workers
0..W-1 each read a 256 KiB table from the ps and send a scalar back, for W in turn: the ps's
threads and RSS, and steps per second.

Per-peer costs are extrapolated to EXTRAPOLATE_TO peers linearly from the largest N (W) measured.
"""
import concurrent.futures
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

from tf_rdma import _transport
from tf_rdma.bench import _common, transport as transport_bench
from tf_rdma.config import load_config
from tf_rdma.sizes import format_size
from tf_rdma.transport import available_backends

# --peers and --workers, when given, take the place of either's.
FULL = {"peers": (8, 64, 256, 1000), "workers": (1, 4, 12), "flow_seconds": 2.0, "steps_budget": 1.0}
QUICK = {"peers": (8, 32), "workers": (1, 2), "flow_seconds": 0.5, "steps_budget": 0.2}
FLOW_SIZE = 64 << 10
FLOW_WARM_UP_SECONDS = 0.5
TABLE_FLOATS = 64 << 10
EXTRAPOLATE_TO = (1000, 10000)
CONNECT_THREADS = 64
RESULT_PREFIX = _common.RESULT_PREFIX
# The longest the receiver may take over a command: its start, `accept` (peers already connected),
# `flow` (FULL's seconds, then up to 60 s to stop granting), with room for a loaded host.
RECEIVER_ANSWER_SECONDS = 300


# ---- what a process costs ----

def process_figures(pid="self"):
    """{threads, rss, vm, fds, mapped} of process `pid` now; mapped: bytes of tf_rdma's shared
    regions (memfd) in its address space, its own and its peers'."""
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            status[name] = value.split()
    mapped = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "memfd:tf_rdma-region" in line:
                start, end = line.split()[0].split("-")
                mapped += int(end, 16) - int(start, 16)
    return {"threads": int(status["Threads"][0]), "rss": int(status["VmRSS"][0]) * 1024,
            "vm": int(status["VmSize"][0]) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")), "mapped": mapped}


def settled_figures(pid, seconds=1.0):
    """process_figures over `seconds`, with the fewest threads seen: threads that only connect
    come and go."""
    deadline = time.monotonic() + seconds
    figures = process_figures(pid)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = process_figures(pid)
        figures = {**now, "threads": min(figures["threads"], now["threads"])}
    return figures


# ---- transport level: the receiver, in a process of its own ----

class Receiver:
    """Accepts peers on `transport` and answers the driver's commands, one JSON line each:
      (start)     process_figures()                       after listening, before any peer
      accept N    process_figures()                       once N peers connected (all idle)
      flow S T    {"bytes": [...], "seconds", "after"}    keeps grants of S bytes out on every
                  connection for T seconds after a warm-up and reports what each peer moved in
                  them, and the figures after; stops granting before it answers (the peers must
                  write until then)."""

    def __init__(self, transport, host):
        self.transport = transport
        self.listener = transport.listen(_common.endpoint(host, 0))
        self.connections = []

    def accept(self, count):
        while len(self.connections) < int(count):
            self.connections.append(self.listener.accept(120))
        return process_figures()

    def flow(self, size, seconds):
        size, seconds = int(size), float(seconds)
        regions = [self.transport.allocate_region(size) for _ in self.connections]
        granting = _transport.SteadyFlow("receive", self.connections, regions, size)
        time.sleep(FLOW_WARM_UP_SECONDS)
        before, started = granting.bytes(), time.monotonic()
        time.sleep(seconds)
        after, ended = granting.bytes(), time.monotonic()
        figures = process_figures()
        granting.stop(60)
        return {"bytes": [b - a for a, b in zip(before, after)], "seconds": ended - started, "after": figures}

    def serve(self, commands=None):
        """Answers commands on stdin until it closes; `commands` adds {name: function(*arguments)}."""
        commands = {"accept": self.accept, "flow": self.flow, **(commands or {})}
        print(json.dumps({"endpoint": self.listener.endpoint, **process_figures()}), flush=True)
        for line in sys.stdin:
            name, *arguments = line.split()
            try:
                answer = commands[name](*arguments)
            except Exception as error:  # noqa: BLE001 - the driver raises it, with its type
                answer = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps(answer), flush=True)


class ReceiverProcess:
    """The driver's side of a receiver process: `python -m tf_rdma.bench.scale receiver BACKEND HOST`,
    or `python -m module BACKEND HOST` (a module serving a Receiver). Its stderr goes to a file, whose
    tail an error gives."""

    def __init__(self, backend, key, host, module=None):
        command = ["-m", module] if module else ["-m", "tf_rdma.bench.scale", "receiver"]
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([sys.executable, *command, backend, host], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.process.stdin.write(key.hex() + "\n")
        self.process.stdin.flush()
        self.start = self.answer()

    def answer(self, seconds=RECEIVER_ANSWER_SECONDS):
        answer = json.loads(_common.line_within(self.process, "", seconds, "the bench's receiver", self.log))
        if "error" in answer:
            raise RuntimeError(f"the bench's receiver: {answer['error']}")
        return answer

    def send(self, *command):
        self.process.stdin.write(" ".join(map(str, command)) + "\n")
        self.process.stdin.flush()

    def ask(self, *command):
        self.send(*command)
        return self.answer()

    def close(self):
        self.process.kill()
        self.process.wait()
        self.log.close()


def receiver_main(backend, host):
    key = bytes.fromhex(sys.stdin.readline().strip())  # never on the command line
    transport = _transport.Transport(backend, name="bench-receiver", cluster_key=key, connect_timeout=120)
    Receiver(transport, host).serve()


def connect_peers(backend, endpoint, count, key=None, name="bench-sender"):
    """`count` connections to `endpoint` made at once from CONNECT_THREADS threads: (the peers'
    transports, the connections, seconds until all connected). Peers of distinct names, each
    within TF_RDMA_MAX_CONNECTIONS_PER_PEER_NAME connections and with one I/O thread."""
    per_name = load_config().max_connections_per_peer_name
    senders = [_transport.Transport(backend, name=f"{name}-{i}", cluster_key=key, connect_timeout=120,
                                    io_threads=1)
               for i in range((count + per_name - 1) // per_name)]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONNECT_THREADS) as pool:
        connections = list(pool.map(lambda i: senders[i // per_name].connect(endpoint), range(count)))
    return senders, connections, time.monotonic() - started


def per_peer(after, before, peers):
    return {name: (after[name] - before[name]) / peers for name in ("threads", "rss", "vm", "fds", "mapped")}


def fairness(moved):
    """min/max bytes per peer (1: all moved the same; 0: one moved nothing)."""
    return min(moved) / max(moved) if max(moved) > 0 else 0.0


def run_peers(backend, peers, flow_seconds, host):
    """One receiver and `peers` peers over `backend`: a row of figures."""
    key = secrets.token_bytes(32)
    receiver = ReceiverProcess(backend, key, host)
    try:
        senders, connections, connect_seconds = connect_peers(backend, receiver.start["endpoint"], peers, key)
        idle = receiver.ask("accept", peers)
        writing = _transport.SteadyFlow("send", connections, size=FLOW_SIZE)
        try:
            moved = receiver.ask("flow", FLOW_SIZE, flow_seconds)
        finally:
            writing.stop(60)
        for connection in connections:  # closed by us first, they end quietly on both sides
            connection.close("the bench is done")
    finally:
        receiver.close()
    return peers_row(backend, peers, connect_seconds, receiver.start, idle, moved)


def peers_row(backend, peers, connect_seconds, start, idle, moved):
    """The row of `peers` peers over `backend` from the receiver's answers: at its `start`, once
    they connected (`idle`) and to `flow` (`moved`)."""
    return {"backend": backend, "peers": peers, "connect_seconds": connect_seconds,
            "threads_before": start["threads"], "threads_idle": idle["threads"],
            "threads_after_traffic": moved["after"]["threads"],
            "before": {k: start[k] for k in ("threads", "rss", "vm", "fds", "mapped")},
            "per_idle_peer": per_peer(idle, start, peers),
            "per_peer_after_traffic": per_peer(moved["after"], start, peers),
            "throughput_gbps": sum(moved["bytes"]) / moved["seconds"] / 1e9,
            "fairness": fairness(moved["bytes"]),
            "min_bytes": min(moved["bytes"]), "max_bytes": max(moved["bytes"])}


# ---- TensorFlow level ----

def tf_workers(spec):
    """Every worker of spec["cluster"] as a server of this one process. Each line on stdin, a
    number W, runs steps in which workers 0..W-1 each read the ps's table and send back a scalar
    (summed on the ps), checks the first step's result, and prints its steps per second."""
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    count = len(spec["cluster"]["worker"])
    servers = [_common.start_server({**spec, "job": "worker", "index": i}) for i in range(count)]
    with tf.device("/job:ps/task:0"):
        table = tf.compat.v1.Variable(tf.ones([TABLE_FLOATS], tf.float32), name="table")
    partials = []
    for i in range(count):
        with tf.device(f"/job:worker/task:{i}"):
            partials.append(tf.reduce_sum(tf.identity(table.read_value()) * float(i + 1)))
    with tf.device("/job:ps/task:0"):
        totals = {w: tf.add_n(partials[:w]) for w in range(1, count + 1)}
    with _common.open_session(servers[0]) as session:
        session.run(table.initializer)
        for line in sys.stdin:
            workers = int(line)
            got, expected = session.run(totals[workers]), TABLE_FLOATS * workers * (workers + 1) / 2
            if got != expected:
                raise RuntimeError(f"a step over {workers} workers summed {got}, not {expected}")
            seconds, steps = _common.timed(lambda: session.run(totals[workers]), spec["budget"])
            print(RESULT_PREFIX + json.dumps({"workers": workers, "steps_per_second": 1 / seconds,
                                              "steps": steps}), flush=True)
    os._exit(0)  # closing would wait for the ps to deregister the graphs


def run_tf(transport, worker_counts, budget, timeout=600):
    """1 ps and max(worker_counts) workers over `transport` ("grpc" or a backend), stepping with
    each count of workers in turn: [{workers, ps_threads, ps_rss, steps_per_second}]."""
    cluster = _common.local_cluster({"ps": 1, "worker": max(worker_counts)})
    ps = _common.start_task("tf_rdma.bench.tf", {"cluster": cluster, "job": "ps", "index": 0,
                                                  "transport": transport}, stderr=subprocess.DEVNULL)
    log = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it while they run
    workers = _common.start_task("tf_rdma.bench.scale", {"cluster": cluster, "transport": transport,
                                                          "budget": budget}, stdin=subprocess.PIPE, stderr=log)
    rows = []
    try:
        for count in sorted(worker_counts):
            workers.stdin.write(f"{count}\n")
            workers.stdin.flush()
            line = json.loads(_common.line_within(workers, RESULT_PREFIX, timeout,
                                                f"bench scale over {transport}: the workers' process", log,
                                                needed=(ps, "the ps")))
            figures = settled_figures(ps.pid)
            rows.append({"workers": count, "ps_threads": figures["threads"], "ps_rss": figures["rss"],
                         "steps_per_second": line["steps_per_second"], "steps": line["steps"]})
    finally:
        for process in (workers, ps):
            process.kill()
            process.wait()
        log.close()
    return rows


# ---- the run, the table, the plot ----

def extrapolate(base, per, peers):
    """Linear: what `peers` peers would cost, from the cost before any and per peer."""
    return base + per * peers


def run(backends, peers=None, workers=None, quick=False, tf=True, host=None, progress=None):
    """{"backends", "unavailable", "limits", "transport": [rows], "tf": {transport: [rows]},
    "extrapolated": {...}}; `peers` and `workers` left None: FULL's, or QUICK's with `quick`."""
    params = dict(QUICK if quick else FULL)
    params["peers"], params["workers"] = peers or params["peers"], workers or params["workers"]
    host = transport_bench.bench_host(host)
    usable = available_backends()
    carried = [b for b in backends if usable.get(b) is None]
    report = {"backends": carried, "quick": quick, "flow_size": FLOW_SIZE,
              "unavailable": {b: usable.get(b, "unknown backend") for b in backends if b not in carried},
              "transport": [], "tf": {}, "extrapolated": {}}
    if progress:
        progress(f"machine limits for {format_size(FLOW_SIZE)} (memcpy, TCP socket)")
    report["limits"] = transport_bench.limits([FLOW_SIZE])[FLOW_SIZE]
    for backend in carried:
        for count in params["peers"]:
            if progress:
                progress(f"{backend}: {count} peers")
            report["transport"].append(run_peers(backend, count, params["flow_seconds"], host))
        largest = max((r for r in report["transport"] if r["backend"] == backend), key=lambda r: r["peers"])
        report["extrapolated"][backend] = {
            n: {name: extrapolate(largest["before"][name], largest["per_idle_peer"][name], n)
                for name in ("threads", "rss", "vm", "fds")} for n in EXTRAPOLATE_TO}
    if tf:
        for transport in ["grpc", *(b for b in carried if b != "verbs")]:
            if progress:
                progress(f"TensorFlow: 1 ps + {', '.join(map(str, params['workers']))} workers over {transport}")
            rows = run_tf(transport, params["workers"], params["steps_budget"])
            report["tf"][transport] = rows
            if len(rows) > 1:
                first, last = rows[0], rows[-1]
                extra = last["workers"] - first["workers"]
                per_worker = {name: (last[f"ps_{name}"] - first[f"ps_{name}"]) / extra for name in ("threads", "rss")}
                report["extrapolated"][f"tf-{transport}"] = {
                    n: {name: extrapolate(first[f"ps_{name}"] - per_worker[name] * first["workers"],
                                          per_worker[name], n) for name in ("threads", "rss")}
                    for n in EXTRAPOLATE_TO}
    return report


def _kib(n):
    return f"{n / 1024:.1f}"


def render(report):
    lines = [f"{backend}: unavailable: {reason}" for backend, reason in report["unavailable"].items()]
    if report["transport"]:
        lines.append(f"transport: one receiver, N peers connected at once, then all writing "
                     f"{format_size(report['flow_size'])} messages (per peer: the receiver's growth / N)")
        lines.append(f"  {'backend':>7} {'peers':>6} {'connect s':>9} {'threads':>11} {'fds/peer':>8} "
                     f"{'RSS KiB/peer':>12} {'after traffic':>13} {'mapped KiB/peer':>15} {'VM KiB/peer':>11} "
                     f"{'GB/s':>6} {'fairness':>8}")
        for r in report["transport"]:
            idle, after = r["per_idle_peer"], r["per_peer_after_traffic"]
            lines.append(f"  {r['backend']:>7} {r['peers']:>6} {r['connect_seconds']:9.2f} "
                         f"{r['threads_before']:>4} -> {r['threads_idle']:<4} {idle['fds']:8.2f} "
                         f"{_kib(idle['rss']):>12} {_kib(after['rss']):>13} {_kib(after['mapped']):>15} "
                         f"{_kib(idle['vm']):>11} {r['throughput_gbps']:6.2f} {r['fairness']:8.2f}")
        limits = report["limits"]
        lines.append(f"  machine limits, same run, {format_size(report['flow_size'])}: memcpy "
                     f"{limits['memcpy_gbps']:.2f} GB/s, TCP socket {limits['tcp_socket_gbps']:.2f} GB/s")
    for transport, rows in report["tf"].items():
        lines.append(f"TensorFlow over {transport}: 1 ps + W workers (the ps's threads and RSS)")
        for r in rows:
            lines.append(f"  {r['workers']:>3} workers: {r['ps_threads']:>4} threads, "
                         f"{r['ps_rss'] / 2**20:7.1f} MiB RSS, {r['steps_per_second']:8.1f} steps/s")
    for name, points in report["extrapolated"].items():
        lines.append(f"extrapolated, {name}: " + "; ".join(
            f"{int(n):,} peers: {p['threads']:.0f} threads, {p['rss'] / 2**20:.1f} MiB RSS"
            + (f", {p['fds']:.0f} fds" if "fds" in p else "") for n, p in points.items()))
    return "\n".join(lines)


def plot(report, path):
    """Receiver threads and RSS per idle peer over N, fairness over N (transport level), and the
    ps's threads over W (TensorFlow level)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 4, figsize=(20, 4))
    panels = [("receiver threads", lambda r: r["threads_idle"]),
              ("receiver RSS per idle peer (KiB)", lambda r: r["per_idle_peer"]["rss"] / 1024),
              ("fairness (min/max bytes per peer)", lambda r: r["fairness"])]
    for ax, (title, value) in zip(axes, panels):
        for backend in report["backends"]:
            rows = [r for r in report["transport"] if r["backend"] == backend]
            ax.plot([r["peers"] for r in rows], [value(r) for r in rows], marker="o", label=f"tf_rdma {backend}")
        ax.set_xscale("log")
        ax.set_xlabel("peers")
        ax.set_title(title)
        ax.legend(fontsize="small")
    ax = axes[3]
    for transport, rows in report["tf"].items():
        ax.plot([r["workers"] for r in rows], [r["ps_threads"] for r in rows], marker="o",
                label="gRPC" if transport == "grpc" else f"tf_rdma {transport}")
    ax.set_xlabel("workers")
    ax.set_title("ps threads (TensorFlow)")
    ax.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver_main(sys.argv[2], sys.argv[3])
    else:
        tf_workers(json.loads(sys.argv[1]))
