"""What tf_rdma's profiler events cost when no profiler records (docs/tensorboard.md): `bench tf` run
in turn on two builds of the same sources, one with the events and one with them compiled out
(CXXFLAGS=-DTF_RDMA_NO_TRACE_EVENTS), in one session, so that both see the same machine.

    python -m tools.events_cost [--rounds 3] [--backend tcp] [--full] [--json FILE]

builds both through setup.py, as pip builds them, into build/events_cost/with_events/ and
build/events_cost/without_events/ (each a whole tf_rdma package; the repository's tf_rdma/ is
untouched), checks that only the first calls TensorFlow's TraceMe recorder, then runs
`python -m tf_rdma bench tf --quick --json --backend BACKEND` on each build in turn, with events,
without, with, ... for --rounds rounds, and prints each workload's steps per second on each build
(median over the rounds, lowest to highest) and their ratio, without events over with, per round.
gRPC's figures come along in every run: they do not go through tf_rdma, so how much they move
between the builds is the noise the comparison has to beat.

With --quick a round took about 2 minutes on 2 busy cores (each bench run starts three clusters of
up to three TensorFlow processes)."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from tf_rdma.transport import BACKENDS, available_backends
from tools.setup_py import build_extensions, load_setup_py

ROOT = Path(__file__).resolve().parents[2]
BUILDS = {"with_events": [], "without_events": ["-DTF_RDMA_NO_TRACE_EVENTS"]}
# Called by a span's end while a profiler records (cc/tf/profiling/trace_span.h): present in the
# TensorFlow side with the events, absent without them.
RECORDER_SYMBOL = "tsl::profiler::TraceMeRecorder::Record"


def build_dir(build):
    return ROOT / "build" / "events_cost" / build


def build(setup_py, name):
    """tf_rdma's Python package and its three binaries, compiled with the caller's CXXFLAGS plus
    BUILDS[name], into build_dir(name)/tf_rdma/."""
    target = build_dir(name)
    shutil.rmtree(target / "tf_rdma", ignore_errors=True)
    shutil.copytree(ROOT / "tf_rdma", target / "tf_rdma", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    callers = os.environ.get("CXXFLAGS", "")
    os.environ["CXXFLAGS"] = " ".join(filter(None, [callers, *BUILDS[name]]))
    try:
        build_extensions(setup_py, setup_py.extensions(), target)
    finally:
        os.environ["CXXFLAGS"] = callers


def calls_the_recorder(name):
    tensorflow_side = next((build_dir(name) / "tf_rdma").glob("_tensorflow.*.so"))
    listed = subprocess.run(["nm", "-DC", "--undefined-only", str(tensorflow_side)], capture_output=True, text=True,
                            check=True).stdout
    return RECORDER_SYMBOL in listed


def bench(name, backend, quick):
    """`python -m tf_rdma bench tf` on build `name`: its JSON report. Run from the build's folder, so
    that it and every task process it starts import that build's tf_rdma."""
    folder = build_dir(name)
    env = {**os.environ, "PYTHONPATH": str(folder)}
    imported = subprocess.run([sys.executable, "-c", "import tf_rdma._tensorflow as t; print(t.__file__)"],
                              cwd=folder, env=env, capture_output=True, text=True)
    if imported.returncode != 0 or not imported.stdout.strip().startswith(str(folder)):
        sys.exit(f"tools.events_cost: bench on {name} would not import its build "
                 f"({imported.stdout.strip() or imported.stderr.strip()[-500:]})")
    command = [sys.executable, "-m", "tf_rdma", "bench", "tf", "--json", "--backend", backend,
               *(["--quick"] if quick else [])]
    ran = subprocess.run(command, cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    if ran.returncode != 0:
        sys.exit(f"tools.events_cost: {' '.join(command)} on {name} failed ({ran.returncode})")
    return json.loads(ran.stdout)


def steps_per_second(report, transport):
    """{case: steps per second} of `transport` (a backend, or "grpc") in a `bench tf` report."""
    figures = {}
    for workload, rows in report["workloads"].items():
        for row in rows:
            if workload == "ps-train":
                case, value = f"ps-train {row['model']}", row[f"{transport}_steps_per_second"]
            else:
                label = {"transfer": lambda r: f"{r['size']} B", "many": lambda r: f"{r['tensors']} x {r['size']} B",
                         "hops": lambda r: f"{r['hops']} hops"}[workload](row)
                case, value = f"{workload} {label}", 1 / row[f"{transport}_seconds"]
            figures[case] = value
    return figures


def summary(runs, backend):
    """Per transport and case: each build's median and range of steps per second over the rounds,
    and the ratio without events / with events of each round."""
    table = {}
    for transport in (backend, "grpc"):
        figures = [(run["build"], steps_per_second(run["report"], transport)) for run in runs]
        for case in figures[0][1]:
            per_build = {name: [cases[case] for build, cases in figures if build == name] for name in BUILDS}
            round_ratios = [without / with_ for with_, without in zip(per_build["with_events"],
                                                                      per_build["without_events"])]
            table.setdefault(transport, {})[case] = {
                **{name: {"median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in per_build.items()},
                "ratio_without_over_with": {"median": statistics.median(round_ratios), "min": min(round_ratios),
                                            "max": max(round_ratios)}}
    return table


def render(table, rounds, backend):
    lines = [f"steps per second, median (lowest-highest) of {rounds} rounds; ratio = without events / with, "
             "per round: median (lowest-highest)"]
    for transport, cases in table.items():
        lines.append(f"{transport}:" + ("" if transport == backend else " (does not go through tf_rdma: the noise)"))
        for case, figures in cases.items():
            cells = [f"{name} {f['median']:.1f} ({f['min']:.1f}-{f['max']:.1f})"
                     for name, f in figures.items() if name in BUILDS]
            ratio = figures["ratio_without_over_with"]
            lines.append(f"  {case:>24}: {'   '.join(cells)}   ratio {ratio['median']:.3f} "
                         f"({ratio['min']:.3f}-{ratio['max']:.3f})")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(prog="python -m tools.events_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="runs on each build, alternating (default 3)")
    parser.add_argument("--backend", default="tcp", choices=BACKENDS, help="the tf_rdma backend to bench (default tcp)")
    parser.add_argument("--full", action="store_true", help="bench tf's full sizes and budgets, not --quick")
    parser.add_argument("--json", metavar="FILE", help="also write every run's report and the summary here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    unusable = available_backends()[args.backend]
    if unusable:
        parser.error(f"--backend {args.backend} is unusable here: {unusable}")
    setup_py = load_setup_py()
    for name in BUILDS:
        build(setup_py, name)
    if not calls_the_recorder("with_events") or calls_the_recorder("without_events"):
        sys.exit(f"tools.events_cost: expected {RECORDER_SYMBOL} called by the with_events build only")
    runs = []
    for round_ in range(args.rounds):
        for name in BUILDS:
            print(f"round {round_ + 1}/{args.rounds}: bench tf on {name}", file=sys.stderr, flush=True)
            # The load average says whether the machine was idle: other work shares its cores.
            load_before = os.getloadavg()[0]
            report = bench(name, args.backend, not args.full)
            runs.append({"build": name, "report": report, "load_average_1min": [load_before, os.getloadavg()[0]]})
    table = summary(runs, args.backend)
    print(render(table, args.rounds, args.backend))
    loads = [load for run in runs for load in run["load_average_1min"]]
    print(f"1-minute load average around the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
