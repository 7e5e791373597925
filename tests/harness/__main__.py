"""python -m tests.harness {soak,chaos}, from the repository's root: long runs that judge what they
saw, print their report and exit 1 if it is not ok or the run could not be made."""
import argparse
import json
import logging
import sys

from tests.harness.flatness import TooFewSamples
from tf_rdma import errors


def _progress(text):
    print(f"tests.harness: {text}", file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.harness")
    runs = parser.add_subparsers(dest="run", required=True)
    soak = runs.add_parser("soak", help="a training loop for --minutes with cancelled steps and a restarted "
                                        "peer, checking that memory, descriptors, threads and pools stay flat")
    soak.add_argument("--backend", default="all", help="tcp, shm, verbs, some of them (tcp,shm) or all (default)")
    soak.add_argument("--minutes", type=float, default=5.0, help="how long each backend runs (default 5; the "
                                                                 "first third is warm-up)")
    chaos = runs.add_parser("chaos", help="ParameterServerStrategy training while a seeded schedule kills, "
                                          "freezes and cuts off tasks in network namespaces (root) and "
                                          "impairs their links (loss, delay, duplication), against gRPC")
    chaos.add_argument("--backend", default="tcp", choices=["tcp"],
                       help="every task runs on a host (network namespace) of its own, joined by veth links: "
                            "tcp (shm has no wire; verbs needs an RDMA link)")
    chaos.add_argument("--minutes", type=float, default=5.0, help="how long the faults last")
    chaos.add_argument("--seed", type=int, default=1, help="the fault schedule's seed")
    for p in (soak, chaos):
        p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    if args.run == "soak":
        from tests.harness import soak as module
        from tf_rdma.transport import BACKENDS
        backends = BACKENDS if args.backend == "all" else tuple(args.backend.split(","))
        run_args, failure, verdict = (backends, args.minutes), module.SoakError, "flat"
    else:
        from tests.harness import chaos as module
        run_args, failure, verdict = (args.backend, args.minutes, args.seed), module.ChaosError, "ok"
    try:
        report = module.run(*run_args, progress=_progress)
    except (failure, TooFewSamples, errors.TransportError) as e:
        print(f"tests.harness {args.run}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else module.render(report))
    return 0 if report[verdict] else 1

if __name__ == "__main__":
    sys.exit(main())
