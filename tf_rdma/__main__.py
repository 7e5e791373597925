"""python -m tf_rdma {info,doctor,secret,bench}"""
import argparse
import importlib.util
import json
import logging
import secrets
import sys

from tf_rdma.sizes import parse_size, parse_sizes


def _progress(text):
    print(f"tf_rdma bench: {text}", file=sys.stderr, flush=True)


def _pin_cpu(text):
    from tf_rdma.bench.transport import allowed_cpu
    try:
        return allowed_cpu(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tf_rdma")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="backends, RDMA devices and limits on this host")
    info.add_argument("--json", action="store_true")
    doctor = commands.add_parser("doctor", help="checks a running cluster from one of its hosts: ports, "
                                                "handshake (same secret), versions, backends, ulimit -l")
    doctor.add_argument("--cluster-spec", help="the cluster as JSON, e.g. '{\"ps\": [\"ps0:2222\"], "
                                               "\"worker\": [\"w0:2222\"]}' (default: TF_CONFIG's)")
    doctor.add_argument("--json", action="store_true")
    commands.add_parser("secret", help="print a fresh 256-bit TF_RDMA_SECRET (for every task of one cluster)")
    bench = commands.add_parser("bench", help="benchmarks against baselines of the same run")
    bench.add_argument("what", choices=["transport", "collective", "tf", "data", "scale"],
                       help="transport: each backend against a socket, memcpy (and perftest for "
                            "verbs); collective: MultiWorkerMirroredStrategy all-reduce against gRPC; "
                            "tf: TensorFlow workloads (transfer, many, hops, step, ps-train, pss) against gRPC; "
                            "data: tf.data service elements (4 KiB to 32 MiB) from workers to a trainer "
                            "against gRPC; "
                            "scale: one receiver and N peers per backend (threads, memory, "
                            "descriptors per peer, throughput, fairness), and a ps serving W workers "
                            "beside gRPC")
    for p in (bench, commands.add_parser("bench-peer", help=argparse.SUPPRESS)):
        p.add_argument("--backend", default="all", help="verbs, tcp, shm or all (default)")
        p.add_argument("--sizes", type=parse_sizes, help="e.g. 4M,64M (transport: 4M,64M; collective: "
                                                    "4K,256K,4M,64M; data: 4K,256K,4M,32M)")
        p.add_argument("--latency-sizes", type=parse_sizes, default=[8, 4096])
        p.add_argument("--bytes-per-size", type=parse_size, default=1 << 30, help="e.g. 64M")
        p.add_argument("--round-trips", type=int, default=500)
        p.add_argument("--host", help="address to bench on (default 127.0.0.1; for verbs, an address of the "
                                      "RDMA netdev)")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--workers", type=lambda t: [int(x) for x in t.split(",")],
                       help="collective: worker counts (default 2,3); data: one count (default 2); "
                            "scale: workers of the ps (default 1,4,12)")
    bench.add_argument("--peers", type=lambda t: [int(x) for x in t.split(",")],
                       help="scale: numbers of peers of the receiver (default 8,64,256,1000)")
    bench.add_argument("--rounds", type=int, help="verbs: interleaved rounds of tf_rdma and perftest, "
                                                  "reported as medians (default 3)")
    bench.add_argument("--verbs-poll-us", type=lambda t: [int(x) for x in t.split(",")],
                       help="transport, verbs: run the latency sizes once per TF_RDMA_VERBS_POLL_US "
                            "value, e.g. 0,50 (default: the configured one)")
    bench.add_argument("--workloads", type=lambda t: t.split(","),
                       help="tf: some of transfer,many,hops,step,ps-train,pss (default all)")
    bench.add_argument("--quick", action="store_true", help="tf, data, scale: smaller sizes and budgets (under a "
                                                            "minute); scale: fewer peers and workers, unless given")
    bench.add_argument("--plot", metavar="FILE.png", help="tf, data, scale: plot the figures (needs matplotlib)")
    bench.add_argument("--busy-cores", action="store_true",
                       help="transport: keep every core awake during the run with idle-priority "
                            "spinners (SCHED_IDLE), so that CPU wake-up latency drops out of both "
                            "tf_rdma's and the socket's latency; the report says which condition")
    bench.add_argument("--pin", type=_pin_cpu, metavar="CPU",
                       help="transport: run the bench and its receiver on this one CPU "
                            "(sched_setaffinity), so that a wake-up is a context switch on that core "
                            "for tf_rdma's ping-pong and the socket's alike, not a wake-up across "
                            "cores; the report says so")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    from tf_rdma import errors
    try:
        if args.command == "info":
            from tf_rdma import info as info_module
            collected = info_module.collect()
            print(json.dumps(collected, indent=2) if args.json else info_module.render(collected))
            if not collected["tensorflow"]["works"]:
                return 1
        elif args.command == "secret":
            # 32 bytes from the operating system's CSPRNG, URL-safe base64: fits an environment
            # variable, a Kubernetes Secret and a shell line as it is.
            print(secrets.token_urlsafe(32))
        elif args.command == "doctor":
            from tf_rdma import doctor as doctor_module
            checked = doctor_module.run(doctor_module.cluster_from(args.cluster_spec))
            print(json.dumps(checked, indent=2) if args.json else doctor_module.render(checked))
            if not checked["healthy"]:
                return 1
        elif args.command == "bench-peer":
            from tf_rdma.bench import transport as bench_transport
            bench_transport.serve(args.backend, args.sizes or [], args.latency_sizes, args.bytes_per_size,
                                  args.round_trips, bench_transport.bench_host(args.host))
        else:
            return _bench(parser, args)
    except errors.TransportError as e:
        print(f"tf_rdma: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _report(module, results, args):
    """Prints a bench's results (a table, or --json) and plots them if asked."""
    print(json.dumps(results, indent=2) if args.json else module.render(results))
    if args.plot:
        module.plot(results, args.plot)


def _bench(parser, args):
    from tf_rdma.transport import BACKENDS
    backends = BACKENDS if args.backend == "all" else tuple(args.backend.split(","))
    if args.plot and args.what not in ("tf", "data", "scale"):
        parser.error(f"--plot is for bench tf, data and scale, not {args.what}")
    if args.pin is not None and args.what != "transport":
        parser.error(f"--pin is for bench transport, not {args.what}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib")
    if args.what == "tf":
        from tf_rdma.bench import tf as bench_tf
        unknown = set(args.workloads or ()) - set(bench_tf.WORKLOADS)
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}: choose from {', '.join(bench_tf.WORKLOADS)}")
        _report(bench_tf, bench_tf.run(backends, args.workloads or bench_tf.WORKLOADS, quick=args.quick,
                                       progress=_progress), args)
    elif args.what == "data":
        from tf_rdma.bench import data as bench_data
        if args.workers and len(args.workers) != 1:
            parser.error("bench data takes one --workers count")
        try:
            report = bench_data.run(backends, workers=args.workers[0] if args.workers else 2,
                                    sizes=args.sizes or bench_data.SIZES, quick=args.quick, progress=_progress)
        except bench_data.ElementsLost as e:
            print(f"tf_rdma: {e}", file=sys.stderr)
            return 1
        _report(bench_data, report, args)
    elif args.what == "scale":
        from tf_rdma.bench import scale as bench_scale
        _report(bench_scale, bench_scale.run(backends, peers=args.peers, workers=args.workers, quick=args.quick,
                                             host=args.host, progress=_progress), args)
    elif args.what == "collective":
        from tf_rdma.bench import collective as bench_collective
        _report(bench_collective, bench_collective.run(
            backends, args.sizes or bench_collective.DEFAULT_SIZES,
            args.workers or bench_collective.DEFAULT_WORKERS, progress=_progress), args)
    else:
        from tf_rdma.bench import transport as bench_transport
        _report(bench_transport, bench_transport.run(backends, args.sizes or bench_transport.DEFAULT_SIZES,
                                                     args.latency_sizes, args.bytes_per_size,
                                                     args.round_trips, host=args.host,
                                                     rounds=args.rounds or bench_transport.DEFAULT_ROUNDS,
                                                     verbs_poll_windows=args.verbs_poll_us,
                                                     busy_cores=args.busy_cores, pin=args.pin), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
