"""`python -m tf_rdma bench tf`: TensorFlow workloads over stock gRPC and each tf_rdma backend, in
one run, each transport in clusters of its own processes on this host.

Workloads (TF1 graphs run by a worker's session, the ps holding the variables; grappler is off so
every transport runs the same graph):
- transfer: one tensor per step, read from a ps variable onto the worker; per size: step time and
  GB/s, beside the machine's limits for the same bytes measured in the same run (a plain memcpy and
  a plain TCP socket stream between two processes: `bench transport`'s baselines).
- many: N tensors of S bytes per step (e.g. 200 x 4 KiB): step time, and time per tensor.
- hops: a chain of dependent small (8-float) hops ps -> worker -> ps ... in one step: time per hop.
- step: what a step costs beside its bytes: a no-op on the ps; a ps counter's increment, fetched;
  an embedding step (rows gathered from a ps table onto the worker, a loss there, the rows updated
  on the ps). Steps per second. Every transport's cluster is up at once and they take turns in
  short windows, round after round: each figure is the median over the rounds, each ratio the
  median of the rounds' ratios (a round's figures come from the same minute of the host's time).
- ps-train: 1 ps + 2 workers training asynchronously, each in its own session: an embedding model
  (sparse lookups and sparse updates of a wide table) and a dense model (>= 50 M parameters; fewer
  with --quick); steps per second summed over the workers. Beside them, the same steps with nothing
  to move: each worker's ops placed on the ps, so only the step itself (the master's RunGraph and
  the step's cleanup) crosses, over gRPC and over each backend (tf_rdma carries those calls too).
  gRPC's is the most a tensor transport alone could give on this host, measured in the same run.
- pss: TF2 ParameterServerStrategy, a coordinator (ClusterCoordinator) + 1 ps + 2 workers: the
  coordinator schedules an embedding step (rows gathered from a ps table, a loss on the worker, the
  rows and a head updated on the ps) and joins; scheduled steps per second. Beside it, in the same
  cluster, the same step function with its ops on the ps: what the coordinator's dispatch and the
  workers' function calls cost with no tensor to move. Its clusters take turns as step's do; the
  nothing-to-move ratios are over gRPC's embedding step in the same round.
Every other figure is a median over timed steps after warm-up, as many as fit a time budget. Ratios
are gRPC's step time over tf_rdma's (higher is better).
"""
import functools
import json
import os
import statistics
import subprocess
import sys
import time

from tf_rdma.bench._common import (RESULT_PREFIX, coordinated_strategy, line_within, local_cluster, open_session,
                                   ratios, start_server, start_task, task_result, timed)
from tf_rdma.bench.transport import limits
from tf_rdma.sizes import format_size
from tf_rdma.transport import available_backends

WORKLOADS = ("transfer", "many", "hops", "step", "ps-train", "pss")
# Workloads of several workers, each figure their steps per second summed, beside the same steps
# with nothing to move.
TRAINING = ("ps-train", "pss")

FULL = {
    "transfer_sizes": [4 << 10, 256 << 10, 4 << 20, 64 << 20, 256 << 20],
    "many": [[200, 4 << 10], [1000, 256]],
    "hops": 50,
    # rounds: each transport's cluster in turn, a window of `window` seconds per step kind each.
    "step": {"vocab": 200_000, "dim": 64, "rows": 512, "rounds": 7, "window": 0.5},
    "embedding": {"vocab": 200_000, "dim": 64, "batch": 1024, "ids_per_example": 8},
    "dense": {"inputs": 4096, "outputs": 12288, "batch": 32},  # 50.3 M parameters
    # per_join: steps the coordinator schedules before it joins, timed together; rounds and window
    # as the step workload's.
    "pss": {"vocab": 200_000, "dim": 64, "batch": 1024, "ids_per_example": 8, "per_join": 20, "rounds": 5,
            "window": 1.5},
    "budget": 1.5,
}
QUICK = {
    "transfer_sizes": [4 << 10, 4 << 20, 64 << 20],
    "many": [[200, 4 << 10]],
    "hops": 50,
    "step": {"vocab": 50_000, "dim": 64, "rows": 512, "rounds": 3, "window": 0.2},
    "embedding": {"vocab": 50_000, "dim": 64, "batch": 512, "ids_per_example": 8},
    "dense": {"inputs": 1024, "outputs": 4096, "batch": 32},
    "pss": {"vocab": 50_000, "dim": 64, "batch": 512, "ids_per_example": 8, "per_join": 10, "rounds": 2,
            "window": 0.4},
    "budget": 0.4,
}


# ---- the tasks of a bench cluster ----

def _transfer(tf, session, params, budget):
    rows = []
    for size in params["transfer_sizes"]:
        with tf.device("/job:ps/task:0"):
            variable = tf.compat.v1.Variable(tf.zeros([size // 4], tf.float32))
        with tf.device("/job:worker/task:0"):
            step = tf.group(tf.identity(variable.read_value()))
        session.run(variable.initializer)
        seconds, steps = timed(lambda: session.run(step), budget)
        rows.append({"size": size, "seconds": seconds, "steps": steps})
    return rows


def _many(tf, session, params, budget):
    rows = []
    for count, size in params["many"]:
        with tf.device("/job:ps/task:0"):
            variables = [tf.compat.v1.Variable(tf.zeros([size // 4], tf.float32)) for _ in range(count)]
        with tf.device("/job:worker/task:0"):
            step = tf.group(*[tf.identity(v.read_value()) for v in variables])
        session.run([v.initializer for v in variables])
        seconds, steps = timed(lambda: session.run(step), budget)
        rows.append({"tensors": count, "size": size, "seconds": seconds, "steps": steps})
    return rows


def _hops(tf, session, params, budget):
    hops = params["hops"]
    with tf.device("/job:ps/task:0"):
        start = tf.compat.v1.Variable(tf.zeros([8], tf.float32))
    value = start.read_value()
    for hop in range(hops):
        with tf.device("/job:worker/task:0" if hop % 2 == 0 else "/job:ps/task:0"):
            value = value + 1.0
    with tf.device("/job:ps/task:0"):
        step = tf.reduce_sum(value)
    session.run(start.initializer)
    seconds, steps = timed(lambda: session.run(step), budget)
    return [{"hops": hops, "seconds": seconds, "steps": steps}]


STEPS = ("no-op", "counter", "embedding")
PSS_STEPS = ("embedding", "nothing_crosses")
# Start the line on which a cluster's measuring task says it is ready, and each of its windows' lines.
READY = "@@ready"
WINDOW = "@@window "


def _step_fetches(tf, session, params):
    """{kind: what session.run runs} of the step workload, its variables initialized."""
    p = params["step"]
    with tf.device("/job:ps/task:0"):
        nothing = tf.no_op()
        counter = tf.compat.v1.Variable(0, dtype=tf.int64, use_resource=True)
        increment = counter.assign_add(1)
        table = tf.compat.v1.Variable(tf.ones([p["vocab"], p["dim"]]), use_resource=True)
    with tf.device("/job:worker/task:0"):
        ids = tf.random.uniform([p["rows"]], 0, p["vocab"], tf.int32)
        rows = tf.gather(table, ids)
        loss = tf.reduce_sum(rows * rows)
        gradient = 2.0 * rows * 1e-6
    with tf.device("/job:ps/task:0"):
        update = table.scatter_sub(tf.IndexedSlices(gradient, ids))
    session.run([counter.initializer, table.initializer])
    return dict(zip(STEPS, (nothing, increment, tf.group(loss, update))))


def _serve_windows(runs, commands):
    """A cluster's measuring task, warm: says it is ready, then for each line `KIND SECONDS` of
    `commands` calls `runs[KIND]()` (which returns the steps it ran) for SECONDS and prints how many
    steps it ran in how long."""
    print(READY, flush=True)
    for command in commands:
        kind, seconds = command.split()
        run, steps = runs[kind], 0
        start = time.perf_counter()
        deadline = start + float(seconds)
        while True:
            steps += run()
            if time.perf_counter() >= deadline:
                break
        print(WINDOW + json.dumps({"steps": steps, "seconds": time.perf_counter() - start}), flush=True)


def run_step(tf, session, fetch):
    """Runs one step of `session`: 1, or 0 for a step TensorFlow aborted for a repeated request id.

    Over stock gRPC, TensorFlow's master names a step's RunGraph requests with ids from 32 random
    bits, and a worker aborts a step whose ids repeat one of the last 100,000 it served (about
    one step in 43,000 past those; tf_rdma's workers name them with ids of their own,
    cc/tf/calls/run_graph_ids.h). Such a step did not run: it counts as none, and the window
    goes on, as a training loop that recovers from the abort would."""
    try:
        session.run(fetch)
    except tf.errors.AbortedError as error:
        if "RunGraph (Worker) request was received twice" not in error.message:
            raise
        print(f"tf_rdma bench: a step aborted for a repeated RunGraph request id: {error.message[:200]}",
              file=sys.stderr, flush=True)
        return 0
    return 1


def _step_runs(tf, session, params):
    """{kind: one step, returning the steps it ran (run_step)} of the step workload, each warmed up."""
    runs = {kind: functools.partial(run_step, tf, session, fetch)
            for kind, fetch in _step_fetches(tf, session, params).items()}
    for one in runs.values():
        for _ in range(20):
            one()
    return runs


def _train_step(tf, model, params, index, nothing_crosses=False):
    """A worker's training op for `model`, its variables on the ps (the chief initializes them);
    `nothing_crosses` runs the worker's ops on the ps too."""
    compute = "/job:ps/task:0" if nothing_crosses else f"/job:worker/task:{index}"
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    if model == "embedding":
        p = params["embedding"]
        with tf.device("/job:ps/task:0"):
            table = tf.compat.v1.get_variable("table", [p["vocab"], p["dim"]], tf.float32,
                                              tf.compat.v1.random_normal_initializer(seed=1),
                                              use_resource=True)
            head = tf.compat.v1.get_variable("head", [p["dim"], 1], tf.float32,
                                             tf.compat.v1.zeros_initializer(), use_resource=True)
        with tf.device(compute):
            ids = tf.random.uniform([p["batch"], p["ids_per_example"]], 0, p["vocab"], tf.int64)
            rows = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
            loss = tf.reduce_mean(tf.square(tf.matmul(rows, head) - 1.0))
            train = optimizer.minimize(loss)  # the table's gradient is sparse: only looked-up rows
    else:
        p = params["dense"]
        with tf.device("/job:ps/task:0"):
            weights = tf.compat.v1.get_variable("weights", [p["inputs"], p["outputs"]], tf.float32,
                                                tf.compat.v1.zeros_initializer(), use_resource=True)
        with tf.device(compute):
            inputs = tf.random.uniform([p["batch"], p["inputs"]])
            loss = tf.reduce_mean(tf.square(tf.matmul(inputs, weights) - 1.0))
            train = optimizer.minimize(loss)
    return train


def _ps_train(tf, session, spec, params, budget):
    rows = []
    for model in ("embedding", "dense"):
        with tf.compat.v1.variable_scope(model):
            train = _train_step(tf, model, params, spec["index"], spec.get("nothing_crosses", False))
            initialized = tf.compat.v1.is_variable_initialized(tf.compat.v1.global_variables(scope=model)[0])
        if spec["index"] == 0:
            session.run(tf.compat.v1.variables_initializer(
                tf.compat.v1.global_variables(scope=model)))
        while not session.run(initialized):
            time.sleep(0.05)
        seconds, steps = timed(lambda: session.run(train), budget)
        rows.append({"model": model, "seconds": seconds, "steps": steps})
    return rows


def _pss_runs(tf, spec):
    """The coordinator's {kind: steps scheduled and joined, returning how many}: the embedding step,
    and the same with its ops on the ps (nothing to move), each warmed up."""
    p = spec["params"]["pss"]
    strategy, coordinator = coordinated_strategy(spec)
    with strategy.scope():
        table = tf.Variable(tf.random.stateless_normal([p["vocab"], p["dim"]], seed=[1, 7]))
        head = tf.Variable(tf.zeros([p["dim"], 1]))

    def train_step():
        ids = tf.random.uniform([p["batch"], p["ids_per_example"]], 0, p["vocab"], tf.int64)
        with tf.GradientTape() as tape:
            rows = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
            loss = tf.reduce_mean(tf.square(tf.matmul(rows, head) - 1.0))
        table_gradient, head_gradient = tape.gradient(loss, [table, head])  # the table's: looked-up rows
        table.scatter_sub(tf.IndexedSlices(0.01 * table_gradient.values, table_gradient.indices))
        head.assign_sub(0.01 * head_gradient)
        return loss

    def on_ps():
        with tf.device("/job:ps/replica:0/task:0"):
            return train_step()

    def scheduled_and_joined(function):
        for _ in range(p["per_join"]):
            coordinator.schedule(function)
        coordinator.join()
        return p["per_join"]

    runs = {kind: functools.partial(scheduled_and_joined, tf.function(step))
            for kind, step in zip(PSS_STEPS, (train_step, on_ps))}
    for one in runs.values():
        for _ in range(2):
            one()
    return runs


def task(spec):
    """One task of a bench cluster, in its own process. TF1 workloads: the ps serves; worker 0 runs
    the one-worker workloads, then every worker ps-train; each worker prints its figures on one
    line. pss: the ps and the workers serve, the chief coordinates and prints the figures."""
    import tensorflow as tf
    pss = spec.get("workloads") == ["pss"]  # bench scale starts a ps with no workloads
    if spec["job"] == "chief":
        _serve_windows(_pss_runs(tf, spec), sys.stdin)
        result = {}
        if spec["transport"] != "grpc":
            import tf_rdma
            result["fallback"] = tf_rdma.stats().get("fallback", {})
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        os._exit(0)  # the servers are killed, not stopped: the coordinator's shutdown would wait on them
    if not pss:
        tf.compat.v1.disable_eager_execution()
    server = start_server(spec)
    if spec["job"] == "ps" or pss:
        server.join()
    params, budget = spec["params"], spec["params"]["budget"]
    one_worker = {"transfer": _transfer, "many": _many, "hops": _hops}
    result = {"workloads": {}}
    with open_session(server) as session:
        if spec["workloads"] == ["step"]:
            _serve_windows(_step_runs(tf, session, params), sys.stdin)
        for workload in spec["workloads"]:
            if workload == "ps-train":
                result["workloads"][workload] = _ps_train(tf, session, spec, params, budget)
            elif workload in one_worker and spec["index"] == 0:
                result["workloads"][workload] = one_worker[workload](tf, session, params, budget)
        if spec["transport"] != "grpc":
            import tf_rdma
            result["fallback"] = tf_rdma.stats().get("fallback", {})
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    os._exit(0)  # closing would wait for the ps to deregister the graphs


def run_cluster(transport, workloads, params, timeout=900, nothing_crosses=False):
    """{workload: [rows of each worker that ran it]} measured on one fresh cluster: a ps and two
    workers (the second only trains). `nothing_crosses`: ps-train's workers run their ops on the ps."""
    workers = 2 if "ps-train" in workloads else 1
    cluster = local_cluster({"ps": 1, "worker": workers})

    def start(job, index):
        return start_task("tf_rdma.bench.tf", {"cluster": cluster, "job": job, "index": index,
                                               "transport": transport, "workloads": list(workloads),
                                               "params": params, "nothing_crosses": nothing_crosses})
    ps = start("ps", 0)
    processes = [start("worker", i) for i in range(workers)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:
        for p in [ps, *processes]:
            p.kill()
            p.wait()
    measured = {}
    for p, (out, err) in zip(processes, outputs):
        result = task_result(p, out, err, f"bench tf over {transport}: a worker")
        for workload, rows in result["workloads"].items():
            measured.setdefault(workload, []).append(rows)
    return measured


def run_in_rounds(workload, transports, params, timeout=600):
    """Steps per second of `workload` ("step" or "pss"), {transport: {kind: [one per round]}}: a
    cluster per transport, all started first, then in each round every kind of step on each
    cluster in turn for a window, the order of the clusters rotating from round to round. A host
    whose speed drifts (another tenant's load, frequency) then moves every transport's figures of a
    round alike, where clusters measured one after the other would each see another speed."""
    p = params[workload]
    kinds, jobs = {"step": (STEPS, {"ps": 1, "worker": 1}),
                   "pss": (PSS_STEPS, {"chief": 1, "ps": 1, "worker": 2})}[workload]
    measuring = "worker" if workload == "step" else "chief"
    # Their ports picked at once: none is bound before all are started.
    ports = local_cluster({job: count * len(transports) for job, count in jobs.items()})
    clusters = {}
    try:
        for i, transport in enumerate(transports):
            cluster = {job: ports[job][i * count:(i + 1) * count] for job, count in jobs.items()}
            processes = {}
            for job, count in jobs.items():
                for index in range(count):
                    spec = {"cluster": cluster, "job": job, "index": index, "transport": transport,
                            "workloads": [workload], "params": params}
                    processes[job, index] = start_task("tf_rdma.bench.tf", spec,
                                                       stdin=subprocess.PIPE if job == measuring else None)
            clusters[transport] = processes
        def line(transport, prefix):
            processes = clusters[transport]
            return line_within(processes[measuring, 0], prefix, timeout,
                               f"bench tf {workload} over {transport}: the {measuring}",
                               needed=(processes["ps", 0], "its ps"))
        for transport in transports:
            line(transport, READY)
        rates = {transport: {kind: [] for kind in kinds} for transport in transports}
        for turn in range(p["rounds"]):
            order = transports[turn % len(transports):] + transports[:turn % len(transports)]
            for kind in kinds:
                for transport in order:
                    commands = clusters[transport][measuring, 0].stdin
                    try:
                        commands.write(f"{kind} {p['window']}\n")
                        commands.flush()
                    except BrokenPipeError:
                        pass  # the process exited: line_within says so, with its log's tail
                    window = json.loads(line(transport, WINDOW))
                    rates[transport][kind].append(window["steps"] / window["seconds"])
        for transport in transports:
            reporter = clusters[transport][measuring, 0]
            out, err = reporter.communicate(input="", timeout=timeout)
            task_result(reporter, out, err, f"bench tf {workload} over {transport}: the {measuring}")
    finally:
        for processes in clusters.values():
            for process in processes.values():
                process.kill()
                process.wait()
    return rates


def _per_round(mine, grpc):
    """The median over the rounds of `mine` over gRPC's in the same round, and those ratios."""
    per_round = [m / g for m, g in zip(mine, grpc)]
    return statistics.median(per_round), per_round


def step_rows(rates, carried):
    """The step workload's rows from run_in_rounds' rates: each transport's median steps per
    second, and each backend's median over the rounds of its rate over gRPC's in the same round."""
    rows = []
    for kind in STEPS:
        row = {"step": kind, "rounds": len(rates["grpc"][kind])}
        for transport in ["grpc", *carried]:
            row[f"{transport}_steps_per_second"] = statistics.median(rates[transport][kind])
        for backend in carried:
            row[f"vs_grpc_{backend}"], row[f"vs_grpc_{backend}_rounds"] = _per_round(
                rates[backend][kind], rates["grpc"][kind])
        rows.append(row)
    return rows


def pss_rows(rates, carried):
    """The pss workload's row from run_in_rounds' rates, as ps-train's: each transport's median
    steps per second for the embedding step and with nothing to move ("nothing_crosses" over gRPC,
    "nothing_crosses_<backend>"), and their medians over the rounds of the rate over gRPC's
    embedding step in the same round."""
    row = {"model": "embedding", "rounds": len(rates["grpc"]["embedding"])}
    grpc = rates["grpc"]["embedding"]
    for transport in ["grpc", *carried]:
        for kind, key in (("embedding", transport), ("nothing_crosses", _nothing_crosses(transport))):
            row[f"{key}_steps_per_second"] = statistics.median(rates[transport][kind])
            if key != "grpc":
                row[f"vs_grpc_{key}"], row[f"vs_grpc_{key}_rounds"] = _per_round(rates[transport][kind], grpc)
    return [row]


def _nothing_crosses(transport):
    """The measurements' key of ps-train with nothing to move over `transport`."""
    return "nothing_crosses" if transport == "grpc" else f"nothing_crosses_{transport}"


def combine(workload, measured, carried, machine=None):
    """Rows of one workload from each transport's measurements ({transport: rows of worker 0, or
    of every worker for ps-train}), with gRPC's time over each backend's. ps-train's come with
    "nothing_crosses" and "nothing_crosses_<backend>": its steps with the workers' ops on the ps,
    over gRPC and over the backend."""
    rows = []
    if workload in TRAINING:
        bounds = [_nothing_crosses(t) for t in ["grpc", *carried]]
        for i, first in enumerate(measured["grpc"][0]):
            row = {"model": first["model"]}
            for transport in ["grpc", *carried, *bounds]:
                # Workers train at once: the cluster's rate is the sum of theirs.
                row[f"{transport}_steps_per_second"] = sum(1 / w[i]["seconds"] for w in measured[transport])
            for backend in [*carried, *bounds]:
                row[f"vs_grpc_{backend}"] = (row[f"{backend}_steps_per_second"]
                                             / row["grpc_steps_per_second"])
            rows.append(row)
        return rows
    for i, first in enumerate(measured["grpc"][0]):
        row = {k: v for k, v in first.items() if k not in ("seconds", "steps")}
        for transport in ["grpc", *carried]:
            row[f"{transport}_seconds"] = measured[transport][0][i]["seconds"]
        for backend in carried:
            row[f"vs_grpc_{backend}"] = ratios(row["grpc_seconds"], row[f"{backend}_seconds"])
        if workload == "transfer":
            for transport in ["grpc", *carried]:
                row[f"{transport}_gbps"] = row["size"] / row[f"{transport}_seconds"] / 1e9
            row.update(machine[row["size"]])
        if workload == "many":
            for transport in ["grpc", *carried]:
                row[f"{transport}_us_per_tensor"] = row[f"{transport}_seconds"] / row["tensors"] * 1e6
        if workload == "hops":
            for transport in ["grpc", *carried]:
                row[f"{transport}_us_per_hop"] = row[f"{transport}_seconds"] / row["hops"] * 1e6
        rows.append(row)
    return rows


def run(backends, workloads=WORKLOADS, quick=False, progress=None):
    """{"backends": [...], "unavailable": {backend: reason}, "workloads": {name: rows}}"""
    params = QUICK if quick else FULL
    usable = available_backends()
    carried = [b for b in backends if usable.get(b) is None]
    report = {"backends": carried, "quick": quick,
              "unavailable": {b: usable.get(b, "unknown backend") for b in backends if b not in carried},
              "workloads": {}}
    machine = None
    if "transfer" in workloads:
        if progress:
            progress("machine limits (memcpy, TCP socket)")
        machine = limits(params["transfer_sizes"])
    in_rounds = {"step": ("step", step_rows),
                 "pss": ("pss (TF2 ParameterServerStrategy), and with nothing to move,", pss_rows)}
    for workload, (what, rows) in in_rounds.items():
        if workload in workloads:
            if progress:
                progress(f"{what} over {', '.join(['grpc', *carried])}, their clusters in turn")
            report["workloads"][workload] = rows(run_in_rounds(workload, ["grpc", *carried], params), carried)
    measured = {transport: {} for transport in ["grpc", *carried]}
    tf1 = [w for w in workloads if w not in in_rounds]
    for transport in ["grpc", *carried]:
        if tf1:
            if progress:
                progress(f"{', '.join(tf1)} over {transport}")
            measured[transport] = run_cluster(transport, tf1, params)
    if "ps-train" in workloads:
        for transport in ["grpc", *carried]:
            if progress:
                progress(f"ps-train with nothing to move (the workers' ops on the ps), over {transport}")
            measured.setdefault(_nothing_crosses(transport), {}).update(
                run_cluster(transport, ["ps-train"], params, nothing_crosses=True))
    for workload in tf1:
        report["workloads"][workload] = combine(
            workload, {transport: m[workload] for transport, m in measured.items() if workload in m},
            carried, machine)
    return report


def render(report):
    lines = [f"{backend}: unavailable: {reason}" for backend, reason in report["unavailable"].items()]
    backends = report["backends"]
    columns = ["grpc", *backends]

    def table(title, rows, label, figure, unit_scale, digits):
        lines.append(title)
        header = f"  {'':>14}" + "".join(f" {t:>9}" for t in columns) + "".join(
            f" {'x ' + b:>8}" for b in backends)
        lines.append(header)
        for row in rows:
            line = f"  {label(row):>14}" + "".join(
                f" {row[figure(t)] * unit_scale:9.{digits}f}" for t in columns)
            line += "".join(f" {row[f'vs_grpc_{b}']:8.2f}" for b in backends)
            lines.append(line)

    w = report["workloads"]
    if "transfer" in w:
        table("transfer: one tensor per step (GB/s; x = gRPC's step time / tf_rdma's)", w["transfer"],
              lambda r: format_size(r["size"]), lambda t: f"{t}_gbps", 1, 2)
        lines.append("  machine limits: " + ", ".join(
            f"{format_size(r['size'])} memcpy {r['memcpy_gbps']:.2f} socket {r['tcp_socket_gbps']:.2f}"
            for r in w["transfer"]))
    if "many" in w:
        table("many: N tensors per step (ms per step)", w["many"],
              lambda r: f"{r['tensors']} x {format_size(r['size'])}", lambda t: f"{t}_seconds", 1e3, 2)
    if "hops" in w:
        table("hops: dependent cross-task hops (us per hop)", w["hops"],
              lambda r: f"{r['hops']} hops", lambda t: f"{t}_us_per_hop", 1, 1)
    if "step" in w:
        table("step: a step's cost beside its bytes (steps per second)", w["step"],
              lambda r: r["step"], lambda t: f"{t}_steps_per_second", 1, 0)
    titles = {"ps-train": ("ps-train: 1 ps + 2 workers (steps per second, both workers)", "the workers' ops"),
              "pss": ("pss: TF2 ParameterServerStrategy, coordinator + 1 ps + 2 workers (scheduled steps per "
                      "second)", "the step function's ops")}
    for workload in TRAINING:
        if workload not in w:
            continue
        title, moved = titles[workload]
        table(title, w[workload], lambda r: r["model"], lambda t: f"{t}_steps_per_second", 1, 1)
        for transport in ["grpc", *backends]:
            key = _nothing_crosses(transport)
            lines.append(f"  nothing to move over {transport} ({moved} on the ps): " + ", ".join(
                f"{r['model']} {r[f'{key}_steps_per_second']:.1f} ({r[f'vs_grpc_{key}']:.2f}x)" for r in w[workload]))
    return "\n".join(lines)


def plot(report, path):
    """One panel per workload, on log scales (figures span orders of magnitude): transfer as lines
    over sizes with the machine's memcpy and socket limits drawn; the other workloads, whose cases
    are not a scale, as bars side by side per transport."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    workloads = report["workloads"]
    figure, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    transports = ["grpc", *report["backends"]]
    panels = {
        "transfer": ("GB/s (higher is better)", lambda r: format_size(r["size"]), lambda r, t: r[f"{t}_gbps"]),
        "many": ("ms per step (lower is better)", lambda r: f"{r['tensors']} x {format_size(r['size'])}",
                 lambda r, t: r[f"{t}_seconds"] * 1e3),
        "hops": ("us per hop (lower is better)", lambda r: f"{r['hops']} hops", lambda r, t: r[f"{t}_us_per_hop"]),
        "step": ("steps/s (higher is better)", lambda r: r["step"], lambda r, t: r[f"{t}_steps_per_second"]),
        "ps-train": ("steps/s (higher is better)", lambda r: r["model"], lambda r, t: r[f"{t}_steps_per_second"]),
        "pss": ("scheduled steps/s (higher is better)", lambda r: r["model"],
                lambda r, t: r[f"{t}_steps_per_second"]),
    }
    width = 0.8 / len(transports)
    for ax, (workload, rows) in zip(axes[0], workloads.items()):
        unit, label, value = panels[workload]
        labels = [label(r) for r in rows]
        for i, transport in enumerate(transports):
            name = "gRPC" if transport == "grpc" else f"tf_rdma {transport}"
            values = [value(r, transport) for r in rows]
            if workload == "transfer":
                ax.plot(labels, values, marker="o", label=name)
            else:
                ax.bar([x + (i - (len(transports) - 1) / 2) * width for x in range(len(rows))], values,
                       width, label=name)
        if workload == "transfer":
            ax.plot(labels, [r["memcpy_gbps"] for r in rows], "k--", label="memcpy")
            ax.plot(labels, [r["tcp_socket_gbps"] for r in rows], "k:", label="TCP socket")
        else:
            if workload in TRAINING:
                ax.hlines([r["nothing_crosses_steps_per_second"] for r in rows],
                          [x - 0.45 for x in range(len(rows))], [x + 0.45 for x in range(len(rows))],
                          colors="k", linestyles="--", label="nothing to move")
            ax.set_xticks(range(len(rows)), labels)
        ax.set_yscale("log")
        ax.set_title(workload)
        ax.set_ylabel(unit)
        ax.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)

if __name__ == "__main__":
    task(json.loads(sys.argv[1]))
