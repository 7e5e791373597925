"""TF2 eager multi-client: a client process computes on a remote worker task and copies tensors
both ways, remote->local and local->remote.

The worker task only serves (a `tf.distribute.Server`, or a `tf_rdma.Server` with `--transport
rdma`). The client connects to the cluster (`tf.config.experimental_connect_to_cluster`, or
`tf_rdma.connect_to_cluster` with the same arguments) and, each round, with float32 tensors of
`--mib` MiB:
  remote->local  `.numpy()` of a tensor computed on the worker; `tf.identity` of a remote tensor
                 onto the client's device; a read of a variable that lives on the worker;
  local->remote  a tensor made on the client as the input of an op placed on the worker, whose
                 result is added into the worker's variable (and copied back, to check it).

How local->remote inputs travel is TensorFlow's choice: by default they ride inside the eager
Enqueue RPC; with TF_EAGER_REMOTE_USE_SEND_TENSOR_RPC=0 (`--local-to-remote rendezvous`) the
worker fetches them through the rendezvous like any remote copy.

    python examples/eager_remote.py --launch-local [--transport rdma] [--rounds 4] [--mib 8]

    # or one command per task:
    python examples/eager_remote.py --cluster 'worker=h1:2222' --job worker --task 0   # serves
    python examples/eager_remote.py --cluster 'worker=h1:2222' --job client            # copies

Every value is deterministic (stateless random ops): `--save PATH` writes each copied tensor's
SHA-256 and sum, and the last round's tensors, so runs over both transports compare bit by bit.
"""
import hashlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster_utils as cu  # noqa: E402

LOCAL_TO_REMOTE = {"enqueue": None, "rendezvous": "0"}   # -> TF_EAGER_REMOTE_USE_SEND_TENSOR_RPC


def parse_args(argv=None):
    p = cu.launcher_parser(__doc__, "start the worker and the client as local processes", timeout=300.0)
    p.add_argument("--job", choices=("worker", "client"))
    p.add_argument("--task", type=int, default=0)
    p.add_argument("--cluster", help="'worker=h:p' (the tasks that serve; default: TF_CONFIG)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--mib", type=float, default=8.0, help="size of each copied tensor")
    p.add_argument("--local-to-remote", choices=sorted(LOCAL_TO_REMOTE), default="enqueue",
                   help="enqueue: TensorFlow's default; rendezvous: "
                        "TF_EAGER_REMOTE_USE_SEND_TENSOR_RPC=0 in the client")
    p.add_argument("--save", help="client: write the results here (.npz)")
    return p.parse_args(argv)


def connect(transport, cluster):
    """The only line that differs between the transports; this process becomes job "localhost"."""
    import tensorflow as tf
    spec = tf.train.ClusterSpec(cluster)
    if transport == "rdma":
        import tf_rdma
        tf_rdma.connect_to_cluster(spec)
    else:
        tf.config.experimental_connect_to_cluster(spec)


def run_client(args, cluster):
    value = LOCAL_TO_REMOTE[args.local_to_remote]
    if value is not None:   # read when the eager context is created: set before importing TF
        os.environ["TF_EAGER_REMOTE_USE_SEND_TENSOR_RPC"] = value
    import numpy as np
    import tensorflow as tf

    t0 = time.monotonic()
    connect(args.transport, cluster)
    remote = "/job:worker/replica:0/task:0/device:CPU:0"
    local = "/job:localhost/replica:0/task:0/device:CPU:0"
    n = int(args.mib * 2**20) // 4
    with tf.device(remote):    # initialized by a remote op: its value never leaves the worker
        variable = tf.Variable(tf.random.stateless_uniform([n], seed=(7, 7)))
    print(f"client: connected to {cluster['worker']} in {time.monotonic() - t0:.1f} s "
          f"({args.transport}); {args.rounds} rounds of {args.mib:g} MiB tensors", flush=True)
    cu.emit(args.events, kind="ready", job="client", task=0, pid=os.getpid())

    results = {}

    def keep(round_, what, array):
        # A digest of every copy keeps the .npz small; the last round's tensors are kept whole.
        name = f"{round_}/{what}"
        results[f"{name}/sha256"] = np.frombuffer(hashlib.sha256(array.tobytes()).digest(), np.uint8)
        results[f"{name}/sum"] = np.float64(array.astype(np.float64).sum())
        if round_ == args.rounds - 1:
            results[f"{name}/last"] = array

    copied = {"remote_to_local": 0, "local_to_remote": 0}
    t = time.perf_counter()
    for round_ in range(args.rounds):
        with tf.device(remote):
            made_remote = tf.random.stateless_uniform([n], seed=(round_, 1))
            doubled = made_remote * 2.0
        # remote->local: .numpy() of a remote result.
        keep(round_, "numpy", made_remote.numpy())
        # remote->local: tf.identity onto this client's device.
        with tf.device(local):
            here = tf.identity(doubled)
        assert here.device.endswith("localhost/replica:0/task:0/device:CPU:0"), here.device
        keep(round_, "identity", here.numpy())
        # local->remote: a tensor made here, the input of an op placed on the worker.
        with tf.device(local):
            made_local = tf.random.stateless_uniform([n], seed=(round_, 2))
        with tf.device(remote):
            there = made_local * 3.0 + 1.0
            variable.assign_add(there)
        assert there.device == remote, there.device
        # remote->local: the worker's variable, read here (and the remote result, to check the
        # local->remote copy bit by bit).
        with tf.device(local):
            read = tf.identity(variable.read_value())
        keep(round_, "variable", read.numpy())
        keep(round_, "remote_result", there.numpy())
        copied["remote_to_local"] += 4 * 4 * n
        copied["local_to_remote"] += 4 * n
    seconds = time.perf_counter() - t
    total = copied["remote_to_local"] + copied["local_to_remote"]
    result = {"kind": "result", "job": "client", "transport": args.transport,
              "rounds": args.rounds, "tensor_bytes": 4 * n, "copied_bytes": copied,
              "local_to_remote_mode": args.local_to_remote, "seconds": seconds,
              "mib_per_sec": total / 2**20 / seconds}
    if args.transport == "rdma":
        result["rdma_stats"] = cu.rdma_stats_summary()
    if args.save:
        np.savez(args.save, **results)
    print(f"client: copied {copied['remote_to_local'] / 2**20:.0f} MiB remote->local and "
          f"{copied['local_to_remote'] / 2**20:.0f} MiB local->remote in {seconds:.2f} s "
          f"({result['mib_per_sec']:.0f} MiB/s)", flush=True)
    cu.emit(args.events, **result)
    return result


def launch_local(args):
    out = sys.stderr if args.json else sys.stdout
    cluster = {"worker": cu.local_cluster(0, 1, transport=args.transport)["worker"]}
    common = ["--cluster", cu.format_cluster(cluster), "--transport", args.transport, "--events"]
    client_argv = common + ["--rounds", args.rounds, "--mib", args.mib,
                            "--local-to-remote", args.local_to_remote]
    if args.save:
        client_argv += ["--save", os.path.abspath(args.save)]
    results, pids, rdma_stats = {}, {}, {}

    def on_event(name, ev):
        if ev.get("kind") in ("serving", "ready"):
            pids[name] = ev.get("pid")
            print(f"[{args.transport}] {name} {ev['kind']} (pid {ev.get('pid')})", file=out,
                  flush=True)
        elif ev.get("kind") == "result":
            results[name] = ev

    def start(lc):
        lc.start("worker0", cu.python_argv(__file__, "--job", "worker", "--task", 0, *common),
                 daemon=True)
        lc.start("client", cu.python_argv(__file__, "--job", "client", *client_argv))
        pids.update(worker0=lc.pid("worker0"), client=lc.pid("client"))

    t0 = time.monotonic()
    left = cu.run_local_cluster(
        args.transport, start, ["client"], on_event, timeout=args.timeout, log_dir=args.log_dir,
        log_prefix="tf_rdma_eager_", out=out,
        missing=lambda: "client" not in results and "the client exited without a result")
    ok = left is not None
    for name, ev in left or []:        # the worker's tf_rdma stats, printed as it stopped
        if ev.get("kind") == "rdma_stats" and ev.get("stats"):
            rdma_stats[name] = ev["stats"]
    if ok:
        r = results["client"]
        if r.get("rdma_stats"):
            rdma_stats["client"] = r["rdma_stats"]
        print(f"[{args.transport}] {r['copied_bytes']['remote_to_local'] / 2**20:.0f} MiB "
              f"remote->local, {r['copied_bytes']['local_to_remote'] / 2**20:.0f} MiB "
              f"local->remote ({args.local_to_remote}): {r['mib_per_sec']:.0f} MiB/s", file=out,
              flush=True)
    return cu.launch_outcome(args, ok, wall_seconds=time.monotonic() - t0, cluster=cluster, pids=pids,
                             result=results.get("client"), rdma_stats=rdma_stats)


def main(argv=None):
    args = parse_args(argv)
    if args.launch_local:
        return launch_local(args)
    cluster, job, task = cu.resolve_task(args.cluster, args.job, args.task)
    if job == "worker":
        cu.serve_until_stopped(args.transport, cluster, job, task, args.events)
    elif job == "client":
        run_client(args, cluster)
        sys.stdout.flush()
        os._exit(0)   # the eager context keeps RPC threads to the worker; do not tear them down
    else:
        raise SystemExit(f"unknown job {job!r}: expected worker or client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
