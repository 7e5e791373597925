"""The coverage table: per workload, the tensor bytes tf_rdma carried and the bytes that still
crossed on gRPC, each run in its own network namespace (see netns.py). As root:

    .venv/bin/python -m tests.tf.coverage.report                      # every workload, grpc and rdma
    .venv/bin/python -m tests.tf.coverage.report --workloads mwms_fit --transports grpc

A grpc run's row is the baseline: all its cross-task bytes are gRPC's. An rdma run uses
TF_RDMA_BACKEND=shm (--backend), whose transfers use no TCP, so its gRPC bytes are what tf_rdma
did not carry. A run that fails prints its error under the table and makes the exit status 1.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.tf.coverage import netns
from tests.tf.coverage.workloads import WORKLOADS


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--transports", default="grpc,rdma")
    p.add_argument("--backend", default="shm", help="TF_RDMA_BACKEND of the rdma runs")
    p.add_argument("--out", help="keep each run's logs and measurement here")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON too")
    args = p.parse_args(argv)
    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(reason)
    out = Path(args.out or tempfile.mkdtemp(prefix="tf_rdma_coverage_"))
    rows, errors, measurements = [], [], []
    for name in args.workloads.split(","):
        for transport in args.transports.split(","):
            print(f"{name} over {transport} ...", file=sys.stderr, flush=True)
            m = netns.measure(name, transport, out / f"{name}-{transport}", backend=args.backend)
            measurements.append(m)
            label = f"{WORKLOADS[name].title} [{transport}]"
            if "error" in m:
                errors.append(f"{label}: {m['error']}")
                rows.append(f"| {label} | FAILED | {m['grpc_bytes']:,} | - |")
            else:
                rows.append(f"| {label} | {m['tensor_bytes_rdma']:,} | {m['grpc_bytes']:,} | "
                            f"{100 * netns.share(m):.2f}% |")
            print(f"  {m['seconds']:.0f} s, loopback {m['loopback_bytes']:,} bytes in "
                  f"{m['loopback_packets']:,} packets", file=sys.stderr, flush=True)
    print("| workload | tensor bytes over tf_rdma | bytes over gRPC | tf_rdma share |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    for error in errors:
        print(f"\nFAILED {error}")
    print(f"\nruns kept in {out}")
    if args.json:
        print(json.dumps(measurements, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
