"""`python -m tf_rdma bench transport`: each backend against the baselines of the same run.

The receiver runs in a second process (`python -m tf_rdma bench-peer`), so the figures include
everything two real processes pay. Baselines, measured between the same two processes in the same
run: a plain single-stream TCP socket moving the same bytes, and a plain memcpy of the same size.

For verbs the bench also runs perftest on the same device, port and GID in the same run, server and
client as two processes: `ib_write_bw` for each throughput size and `ib_write_lat` for each latency
size. verbs' figures are then also given as ratios to those (`vs_ib_write_bw`: tf_rdma's throughput
over ib_write_bw's, higher is better; `vs_ib_write_lat`: tf_rdma's one-way latency over
ib_write_lat's, lower is better). What makes the two comparable:
- the same message size (`-s`), and the same number of messages (`-n`) as tf_rdma moves;
- the same pipelining: perftest's send queue depth `-t` is set to tf_rdma's grant depth (the number
  of messages the receiver keeps granted, hence the writes that can be in flight: 4), not
  perftest's default of 128;
- both figures are averages over the whole run, taken at the sender (ib_write_bw's "BW average",
  ib_write_lat's "t_avg", which is half the round trip, as tf_rdma's latency is);
- the device, port and GID index are those the verbs backend uses, as it chooses them
  (`verbs_device`): the device and port of the bench host's IP address as rdma_cm resolves them,
  its RoCE v2 GID, or TF_RDMA_VERBS_DEVICE, _PORT and _GID_INDEX when set.
Not the same: ib_write_lat busy-polls the landing buffer; tf_rdma polls its completion queue for
TF_RDMA_VERBS_POLL_US after each completion, then sleeps on completion events.
`verbs_poll_windows` (`--verbs-poll-us 0,50`) runs the latency sizes once per value in each round.
Each latency row also gives the driving process's CPU use during its round trips (100% = a core).

`pin` (`--pin CPU`) runs the whole bench on that one CPU: the bench, its receiver (and perftest's
server and client) inherit it. A wake-up is then a context switch on that core, for tf_rdma's
ping-pong and the socket's alike, rather than whichever placement the scheduler picks for each,
which on a VM can differ by 10x between runs; the ratios then compare the software paths. Each
backend's report gives the CPU (`pinned_cpu`) and the CPUs its receiver's threads were allowed
(`receiver_cpus`, read as the receiver started serving and when the run ended).

A shared or emulated host (Soft-RoCE under TCG) can swing by 2x between runs seconds apart, so verbs
is measured in `rounds` rounds: in each, every throughput size is one tf_rdma run and one
ib_write_bw run back to back (and the latency sizes one tf_rdma run and one ib_write_lat run), the
order alternating between rounds so a load that rises or falls through the bench favours neither.
Each figure is then the median over the rounds, and each ratio the median of the rounds' own
ratios (each taken between two runs seconds apart), with `_min`/`_max` giving the spread and
`rounds` every round's figures.

The transport listens on `host` (`--host`, else 127.0.0.1); verbs needs an address of the RDMA
netdev there, since rdma_cm picks the device by IP address.
"""
import contextlib
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time

from tf_rdma import _transport
from tf_rdma.bench._common import PEER_START_SECONDS, endpoint, line_within
from tf_rdma.config import load_config
from tf_rdma.errors import TransportError
from tf_rdma.sizes import format_size, parse_sizes
from tf_rdma.transport import available_backends

DEFAULT_SIZES = (4 << 20, 64 << 20)
DEFAULT_LATENCY_SIZES = (8, 4096)
DEFAULT_ROUNDS = 3
DEFAULT_HOST = "127.0.0.1"  # where the bench listens unless `host` is given


def bench_host(host=None):
    return host or DEFAULT_HOST


def grant_depth():
    """Messages the receiver keeps granted at once (transport_bench.h's BenchPlan::depth)."""
    return _transport.BenchPlan().depth


def iterations(bytes_per_size, size):
    """Messages tf_rdma moves per size (as transport_bench.cc's Iterations)."""
    return min(max(bytes_per_size // max(size, 1), 8), 20000)


def plan(sizes, latency_sizes, bytes_per_size, round_trips):
    p = _transport.BenchPlan()
    p.sizes = list(sizes)
    p.latency_sizes = list(latency_sizes)
    p.bytes_per_size = bytes_per_size
    p.latency_round_trips = round_trips
    return p


def _plan_args(sizes, latency_sizes, bytes_per_size, round_trips):
    return ["--sizes", ",".join(map(str, sizes)), "--latency-sizes", ",".join(map(str, latency_sizes)),
            "--bytes-per-size", str(bytes_per_size), "--round-trips", str(round_trips)]


def serve(backend, sizes, latency_sizes, bytes_per_size, round_trips, host):
    """The bench peer: listens on `host`, prints its ports on one line, then serves one driver."""
    key = sys.stdin.readline().strip()  # the driver's one-off cluster key; never on the command line

    def ready(transport_port, baseline_port):
        print(f"READY {transport_port} {baseline_port}", flush=True)

    _transport.bench_serve(backend, plan(sizes, latency_sizes, bytes_per_size, round_trips), host, 0,
                           bytes.fromhex(key).decode("latin-1"), ready)


@contextlib.contextmanager
def _environment(settings):
    """`settings` in this process's environment, where the transport's C++ side reads its
    configuration when it starts; restored afterwards."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def threads_cpus(pid):
    """The CPUs any thread of process `pid` may run on; threads (or the process) gone meanwhile
    count for nothing."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return set()
    cpus = set()
    for thread in threads:
        with contextlib.suppress(ProcessLookupError):
            cpus |= os.sched_getaffinity(int(thread))
    return cpus


def run_backend(backend, sizes, latency_sizes, bytes_per_size, round_trips, host=None, settings=None):
    """One run of the transport bench; `settings` (TF_RDMA_* name -> value) apply to both of its
    processes. The report's `receiver_cpus` are those the receiver's threads may run on."""
    host = bench_host(host)
    settings = settings or {}
    key = secrets.token_hex(16)
    peer = subprocess.Popen(
        [sys.executable, "-m", "tf_rdma", "bench-peer", "--backend", backend, "--host", host,
         *_plan_args(sizes, latency_sizes, bytes_per_size, round_trips)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **settings})
    try:
        peer.stdin.write(key + "\n")
        peer.stdin.close()
        ports = line_within(peer, "READY ", PEER_START_SECONDS, f"the bench peer for {backend}").split()
        receiver_cpus = threads_cpus(peer.pid)
        with _environment(settings):
            report = _transport.bench_drive(
                backend, plan(sizes, latency_sizes, bytes_per_size, round_trips),
                endpoint(host, ports[0]), endpoint(host, ports[1]), bytes.fromhex(key).decode("latin-1"))
        receiver_cpus |= threads_cpus(peer.pid)
        peer.wait(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait()
    report["receiver_cpus"] = sorted(receiver_cpus)
    return add_baseline_ratios(report)


def limits(sizes, bytes_per_size=1 << 30):
    """{size: {"memcpy_gbps", "tcp_socket_gbps"}}: the machine's limits for moving `size` bytes,
    measured between two processes by this bench's baselines (what the other benches compare with)."""
    report = run_backend("tcp", sizes, [], bytes_per_size, 1)
    return {row["size"]: {"memcpy_gbps": row["memcpy_gbps"], "tcp_socket_gbps": row["tcp_socket_gbps"]}
            for row in report["throughput"]}


def add_baseline_ratios(report):
    """tf_rdma's figures over the baselines' of the same run: throughput (higher is better) and
    latency (lower is better) alike, transport / baseline."""
    for row in report["throughput"]:
        row["vs_tcp_socket"] = row["transport_gbps"] / row["tcp_socket_gbps"]
        row["vs_memcpy"] = row["transport_gbps"] / row["memcpy_gbps"]
    for row in report["latency"]:
        row["vs_tcp_socket"] = row["transport_us"] / row["tcp_socket_us"]
    return report


# ---- perftest on the device verbs uses ----

class PerftestError(RuntimeError):
    pass


def verbs_device(host, environ=None):
    """(device, port, gid_index, how the GID was chosen) for perftest: those of the verbs backend's
    connections from `host`, under the TF_RDMA_* settings of `environ` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return _transport.verbs_local_port(host, {k: v for k, v in environ.items() if k.startswith("TF_RDMA_")})


_HEADER_NAME = re.compile(r"#\w+|(?:[\w.%]+ )?[\w.%]+\[[^\]]*\]")


def parse_perftest(text, size):
    """{column name: value} of perftest's result row for `size` ("BW average[MB/sec]": 19.66, ...)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "#bytes" not in line:
            continue
        names = _HEADER_NAME.findall(line)
        for row in lines[i + 1:]:
            fields = row.split()
            if not fields or fields[0] != str(size):
                continue
            values = {}
            for name, field in zip(names, fields):
                try:
                    values[name] = float(field)
                except ValueError:
                    pass
            return values
    raise PerftestError(f"no result row for {size} bytes in the output:\n{_tail(text)}")


def _column(values, prefix):
    for name, value in values.items():
        if name.startswith(prefix):
            return name, value
    raise PerftestError(f"no '{prefix}' column in perftest's result ({sorted(values)})")


def bandwidth_gbps(values):
    """perftest's BW average in GB/s (1e9 bytes/s, as tf_rdma's figures): MB/sec there is MiB/s."""
    name, value = _column(values, "BW average[")
    unit = name[name.index("[") + 1:-1].lower()
    scale = {"mb/sec": (1 << 20) / 1e9, "gb/sec": 1 / 8}.get(unit)
    if scale is None:
        raise PerftestError(f"unknown bandwidth unit in '{name}'")
    return value * scale


def _tail(text, lines=12):
    return "\n".join(text.strip().splitlines()[-lines:])


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _setting(text, name):
    match = re.search(rf"^\s*{re.escape(name)}\s*:\s*(\d+)", text, re.M)
    return int(match.group(1)) if match else None


def run_perftest_pair(tool, args, host, timeout, connect_timeout=20.0):
    """Runs `tool args` as server and `tool args host` as client; returns the client's output."""
    command = [tool, *args, "-p", str(_free_port())]
    deadline = time.monotonic() + timeout
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        connect_deadline = time.monotonic() + connect_timeout
        while True:
            try:
                client = subprocess.run([*command, host], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise PerftestError(f"{' '.join(command)} {host}: no result within {timeout:.0f} s")
            if client.returncode == 0:
                break
            # The server needs a moment to listen; anything else is a real failure.
            if (server.poll() is not None or "connect" not in client.stdout.lower()
                    or time.monotonic() > connect_deadline):
                server_output = server.communicate(timeout=5)[0] if server.poll() is not None else ""
                raise PerftestError(f"{' '.join(command)} {host} failed (exit {client.returncode}):\n"
                                    f"{_tail(client.stdout)}\nserver:\n{_tail(server_output or '')}")
            time.sleep(0.25)
        try:
            server.communicate(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # the client's figures stand; the server is killed below
        return client.stdout
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def run_perftest(sizes, latency_sizes, bytes_per_size, round_trips, host, depth):
    """perftest on the device verbs uses; never raises: says what is missing or failed instead."""
    missing = [tool for tool in ("ib_write_bw", "ib_write_lat") if shutil.which(tool) is None]
    if missing:
        return {"available": False,
                "reason": f"perftest is not installed ({', '.join(missing)} not found on PATH); "
                          "install the perftest package to compare against it"}
    try:
        device, port, gid_index, chosen = verbs_device(host)
    except TransportError as e:
        return {"available": False, "reason": f"no device for perftest: {e}"}
    common = ["-d", device, "-i", str(port), "-x", str(gid_index), "-F"]
    result = {"available": True, "device": device, "port": port, "gid_index": gid_index,
              "device_chosen_by": chosen, "grant_depth": depth, "mtu": None,
              "ib_write_bw": {}, "ib_write_lat": {}, "errors": []}
    for size in sizes:
        n = iterations(bytes_per_size, size)
        tx_depth = min(depth, n)
        args = [*common, "-s", str(size), "-n", str(n), "-t", str(tx_depth)]
        try:
            output = run_perftest_pair("ib_write_bw", args, host, timeout=60 + n * size / 2e6)
            result["ib_write_bw"][size] = {
                "gbps": bandwidth_gbps(parse_perftest(output, size)), "iterations": n,
                # What perftest says it used (None if it did not say), not what it was asked for.
                "tx_depth": _setting(output, "TX depth"),
                "command": " ".join(["ib_write_bw", *args])}
            result["mtu"] = result["mtu"] or _setting(output, "Mtu")
        except (PerftestError, OSError) as e:
            result["errors"].append(f"ib_write_bw -s {size}: {e}")
    for size in latency_sizes:
        args = [*common, "-s", str(size), "-n", str(max(round_trips, 5))]
        try:
            output = run_perftest_pair("ib_write_lat", args, host, timeout=60 + round_trips * 0.05)
            values = parse_perftest(output, size)
            result["ib_write_lat"][size] = {
                "avg_us": _column(values, "t_avg")[1], "typical_us": _column(values, "t_typical")[1],
                "command": " ".join(["ib_write_lat", *args])}
            result["mtu"] = result["mtu"] or _setting(output, "Mtu")
        except (PerftestError, OSError) as e:
            result["errors"].append(f"ib_write_lat -s {size}: {e}")
    return result


def add_perftest(report, perftest):
    """Puts perftest's figures and tf_rdma's ratios to them into verbs' rows."""
    report["perftest"] = perftest
    bw = perftest.get("ib_write_bw", {})
    lat = perftest.get("ib_write_lat", {})
    for row in report["throughput"]:
        figure = bw.get(row["size"], {}).get("gbps")
        row["ib_write_bw_gbps"] = figure
        row["vs_ib_write_bw"] = row["transport_gbps"] / figure if figure else None
    for row in report["latency"]:
        figure = lat.get(row["size"], {})
        row["ib_write_lat_us"] = figure.get("avg_us")
        row["ib_write_lat_typical_us"] = figure.get("typical_us")
        row["vs_ib_write_lat"] = row["transport_us"] / figure["avg_us"] if figure.get("avg_us") else None
    # JSON object keys are strings; keep the per-size tables readable there too.
    for table in ("ib_write_bw", "ib_write_lat"):
        if table in perftest:
            perftest[table] = {str(size): figures for size, figures in perftest[table].items()}
    return report


# Per-round figures of the rows, summarized as medians; the ratios also get their spread.
_THROUGHPUT_FIGURES = ("transport_gbps", "tcp_socket_gbps", "memcpy_gbps", "vs_tcp_socket", "vs_memcpy",
                       "ib_write_bw_gbps", "vs_ib_write_bw")
_LATENCY_FIGURES = ("transport_us", "transport_cpu_percent", "tcp_socket_us", "vs_tcp_socket",
                    "ib_write_lat_us", "ib_write_lat_typical_us", "vs_ib_write_lat")


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_rows(rows, figures):
    """One row per size (and verbs poll window) from each round's rows of that size: medians,
    spread of the ratios, rounds."""
    by_size = {}
    for row in rows:
        by_size.setdefault((row["size"], row.get("poll_us")), []).append(row)
    summary = []
    for same in by_size.values():
        row = {key: value for key, value in same[0].items() if key not in figures}
        for figure in figures:
            row[figure] = _median(r[figure] for r in same)
            if figure.startswith("vs_"):
                values = [r[figure] for r in same if r[figure] is not None]
                row[f"{figure}_min"] = min(values, default=None)
                row[f"{figure}_max"] = max(values, default=None)
        row["rounds"] = [{figure: r[figure] for figure in figures} for r in same]
        summary.append(row)
    return summary


def summarize_perftest(runs):
    """perftest's runs of all rounds as one table: median figures, and each round's."""
    tables = ("ib_write_bw", "ib_write_lat")
    summary = {key: value for key, value in runs[0].items() if key not in tables + ("errors",)}
    if not summary.get("available"):
        return summary
    summary["mtu"] = next((run["mtu"] for run in runs if run.get("mtu")), None)
    summary["errors"] = [error for run in runs for error in run.get("errors", [])]
    for table, figures in zip(tables, (("gbps",), ("avg_us", "typical_us"))):
        merged = {}
        for run in runs:
            for size, result in run.get(table, {}).items():
                merged.setdefault(size, []).append(result)
        summary[table] = {}
        for size, results in merged.items():
            entry = dict(results[0])
            for figure in figures:
                entry[figure] = _median(r[figure] for r in results)
                entry[f"rounds_{figure}"] = [r[figure] for r in results]
            summary[table][str(size)] = entry
    return summary


def run_verbs(sizes, latency_sizes, bytes_per_size, round_trips, host, rounds=DEFAULT_ROUNDS,
              poll_windows=None):
    """verbs against perftest, in interleaved rounds (see the module docstring). The latency sizes
    run once per TF_RDMA_VERBS_POLL_US value of `poll_windows` in each round (default: the
    configured one), so both modes and ib_write_lat are measured minutes apart at most."""
    depth = grant_depth()
    if poll_windows is None:
        poll_windows = [load_config().verbs_poll_us]
    pairs = [([size], [], [None]) for size in sizes]
    if latency_sizes:
        pairs.append(([], latency_sizes, poll_windows))
    rows, latency_rows, perftest_runs, receiver_cpus = [], [], [], set()
    for index in range(rounds):
        for pair_sizes, pair_latency_sizes, windows in pairs:
            args = (pair_sizes, pair_latency_sizes, bytes_per_size, round_trips, host)

            def ours():
                reports = []
                for window in windows:
                    settings = {} if window is None else {"TF_RDMA_VERBS_POLL_US": str(window)}
                    report = run_backend("verbs", *args, settings=settings)
                    for row in report["latency"]:
                        row["poll_us"] = window
                    reports.append(report)
                return reports

            if index % 2 == 0:
                reports = ours()
                perftest = run_perftest(*args, depth)
            else:
                perftest = run_perftest(*args, depth)
                reports = ours()
            perftest_runs.append(perftest)
            for report in reports:
                add_perftest(report, dict(perftest))  # a copy: it rekeys the tables for JSON
                rows += report["throughput"]
                latency_rows += report["latency"]
                receiver_cpus.update(report["receiver_cpus"])
    return {"rounds": rounds, "receiver_cpus": sorted(receiver_cpus),
            "throughput": summarize_rows(rows, _THROUGHPUT_FIGURES),
            "latency": summarize_rows(latency_rows, _LATENCY_FIGURES),
            "perftest": summarize_perftest(perftest_runs)}


@contextlib.contextmanager
def cores_kept_awake(enabled):
    """With `enabled`, one spinning process per core at idle priority (SCHED_IDLE: it runs only
    when nothing else wants the core) for the duration: the cores never sleep, so waking a thread
    costs a context switch, not a C-state exit. Latency then compares the software paths."""
    if not enabled:
        yield
        return
    spin = ("import os, sys\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
            "sys.stdout.write('spinning\\n'); sys.stdout.flush()\nwhile True: pass\n")
    spinners = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
                for _ in range(os.cpu_count() or 1)]
    try:
        for spinner in spinners:
            line_within(spinner, "spinning", PEER_START_SECONDS, "a process keeping a core awake")
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def allowed_cpu(cpu):
    """`cpu` (an int, or its text) if this process may run on it, else a ValueError that names the
    CPUs it may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        number = int(cpu)
    except ValueError:
        number = None
    if number not in allowed:
        raise ValueError(f"{cpu!r} is not a CPU this process may run on; it may run on "
                         f"{', '.join(map(str, allowed))}")
    return number


@contextlib.contextmanager
def pinned_to(cpu):
    """With a `cpu`, this thread on that CPU alone for the duration, and with it every thread and
    process it starts meanwhile (they inherit its affinity); restored afterwards."""
    if cpu is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def run(backends, sizes=DEFAULT_SIZES, latency_sizes=DEFAULT_LATENCY_SIZES,
        bytes_per_size=1 << 30, round_trips=500, host=None, rounds=DEFAULT_ROUNDS, verbs_poll_windows=None,
        busy_cores=False, pin=None):
    """`pin`: a CPU to run the bench and its receivers on (see the module docstring)."""
    sizes, latency_sizes = parse_sizes(sizes), parse_sizes(latency_sizes)
    pin = None if pin is None else allowed_cpu(pin)
    host = bench_host(host)
    usable = available_backends()
    results = {}
    # The spinners keep every core awake, so they start before the pin (they would inherit it).
    with cores_kept_awake(busy_cores), pinned_to(pin):
        for backend in backends:
            if usable[backend] is not None:
                results[backend] = {"unavailable": usable[backend]}
                continue
            if backend == "verbs":
                results[backend] = run_verbs(sizes, latency_sizes, bytes_per_size, round_trips, host, rounds,
                                             verbs_poll_windows)
            else:
                results[backend] = run_backend(backend, sizes, latency_sizes, bytes_per_size, round_trips,
                                               host)
                poll_us = load_config().stream_poll_us  # both processes' (the environment's)
                for row in results[backend].get("latency", []):
                    row["poll_us"] = poll_us
            results[backend]["cores"] = "kept awake (--busy-cores)" if busy_cores else "free to sleep"
            results[backend]["pinned_cpu"] = pin
    return results


def _figure(value, width, digits=2):
    return f"{value:{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def _spread(row, ratio):
    low, high = row.get(f"{ratio}_min"), row.get(f"{ratio}_max")
    return f" ({low:.2f}-{high:.2f})" if low is not None and high is not None else ""


def _pinning(report):
    cpu = report["pinned_cpu"]
    return f", pinned to CPU {cpu} (bench and receiver)" if cpu is not None else ""


def render(results):
    lines = []
    for backend, report in results.items():
        if "unavailable" in report:
            lines.append(f"{backend}: unavailable: {report['unavailable']}")
            continue
        perftest = report.get("perftest")
        lines.append(f"{backend}: throughput (GB/s), same run, same two processes{_pinning(report)}")
        header = f"  {'size':>8} {'tf_rdma':>8} {'tcp sock':>9} {'memcpy':>8} {'vs sock':>8} {'vs memcpy':>9}"
        lines.append(header + (f" {'ib_write_bw':>11} {'vs ib_bw':>8}" if perftest else ""))
        for r in report["throughput"]:
            line = (f"  {format_size(r['size']):>8} {r['transport_gbps']:8.2f} {r['tcp_socket_gbps']:9.2f} "
                    f"{r['memcpy_gbps']:8.2f} {r['vs_tcp_socket']:8.2f} {r['vs_memcpy']:9.2f}")
            if perftest:
                line += f" {_figure(r['ib_write_bw_gbps'], 11, 3)} {_figure(r['vs_ib_write_bw'], 8)}"
                line += _spread(r, "vs_ib_write_bw")
            lines.append(line)
        lines.append(f"{backend}: one-way latency (us), cores {report['cores']}{_pinning(report)}")
        for r in report["latency"]:
            line = (f"  {format_size(r['size']):>8} {r['transport_us']:8.1f}"
                    + (f" polling {r['poll_us']} us" if r.get("poll_us") is not None else "")
                    + f", CPU {r['transport_cpu_percent']:.0f}%; vs tcp socket "
                    f"{r['tcp_socket_us']:.1f} (ratio {r['vs_tcp_socket']:.2f})")
            if perftest and r.get("ib_write_lat_us") is not None:
                line += (f"; vs ib_write_lat {r['ib_write_lat_us']:.1f} avg (ratio "
                         f"{r['vs_ib_write_lat']:.2f}{_spread(r, 'vs_ib_write_lat')}), "
                         f"{r['ib_write_lat_typical_us']:.1f} typical")
            lines.append(line)
        if perftest:
            if not perftest.get("available"):
                lines.append(f"{backend}: perftest: {perftest['reason']}")
            else:
                lines.append(
                    f"{backend}: perftest on {perftest['device']} port {perftest['port']} GID index "
                    f"{perftest['gid_index']} ({perftest['device_chosen_by']}), MTU {perftest['mtu']}; "
                    f"ib_write_bw -t {perftest['grant_depth']} = tf_rdma's grant depth, same -s and -n; "
                    f"medians of {report['rounds']} interleaved rounds, (min-max) of the ratios")
                lines += [f"  perftest failed: {line}" for e in perftest["errors"]
                          for line in e.splitlines()[:1]]
    return "\n".join(lines)
