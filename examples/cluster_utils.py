"""What the examples share: the transport switch, the dataset, cluster specs, and a supervisor that
runs a whole TensorFlow cluster as local processes and never leaves one behind.

Nothing here imports TensorFlow at module level, so a launcher that only supervises stays light.
"""
import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tf_rdma.ports import free_ports

TRANSPORTS = ("grpc", "rdma")
EVENT_PREFIX = "@@event "


# ---------------------------------------------------------------------------------------------
# The transport switch: the only line that differs between a gRPC and a tf_rdma cluster.

def launcher_parser(doc, launch_help, timeout=600.0):
    """The command line every example shares: run one task, or `--launch-local` every task of a
    local cluster, over `--transport`; each example adds its own options."""
    import argparse
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch-local", action="store_true", help=launch_help)
    p.add_argument("--transport", choices=TRANSPORTS, default="grpc")
    p.add_argument("--timeout", type=float, default=timeout,
                   help="--launch-local: seconds allowed for the whole run")
    p.add_argument("--events", action="store_true", help="machine-readable progress lines")
    p.add_argument("--json", action="store_true", help="--launch-local: print a JSON summary")
    p.add_argument("--log-dir", help="--launch-local: keep the tasks' logs here")
    return p


def launch_outcome(args, ok, **summary):
    """A launcher's exit code; with --json its summary ("ok" and `summary`) goes to stdout."""
    if args.json:
        print(json.dumps({"ok": ok, **summary}, indent=2))
    return 0 if ok else 1


def server_class(transport):
    """The class to build this task's server with: `tf.distribute.Server` or `tf_rdma.Server`.

    Both take (server_or_cluster_def, job_name, task_index, protocol, config, start) and expose
    .target, .join() and .server_def. tf_rdma is imported only when asked for.
    """
    if transport == "grpc":
        import tensorflow as tf
        return tf.distribute.Server
    if transport == "rdma":
        try:
            import tf_rdma
        except ImportError as e:
            raise RuntimeError(f"--transport rdma needs the tf_rdma package: {e}") from e
        server = getattr(tf_rdma, "Server", None)
        if server is None:
            raise RuntimeError(
                "--transport rdma: this tf_rdma build has no tf_rdma.Server yet "
                f"({tf_rdma.__file__}); use --transport grpc")
        return server
    raise ValueError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")


# ---------------------------------------------------------------------------------------------
# Data: scikit-learn's digits (8x8 images, 10 classes, 1797 samples), shipped with the package.

def load_digits_split(test_fraction=0.2, seed=0):
    """(x_train, y_train, x_test, y_test): float32 features standardized with the training split's
    statistics, int64 labels; the split is stratified and the same in every process."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype(np.float32), data.target.astype(np.int64),
        test_size=test_fraction, random_state=seed, stratify=data.target)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0          # a few border pixels are always 0
    return ((x_train - mean) / std, y_train, (x_test - mean) / std, y_test)


NUM_FEATURES = 64
NUM_CLASSES = 10


def mlp_parameter_count(hidden):
    sizes = [NUM_FEATURES] + list(hidden) + [NUM_CLASSES]
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


# ---------------------------------------------------------------------------------------------
# Cluster descriptions.

def parse_cluster(text):
    """'ps=h:p;worker=h:p,h:p' -> {'ps': ['h:p'], 'worker': ['h:p', 'h:p']}."""
    cluster = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        job, sep, addresses = part.partition("=")
        if not sep or not job.strip():
            raise ValueError(f"bad --cluster part {part!r}; expected job=host:port[,host:port...]")
        hosts = [a.strip() for a in addresses.split(",") if a.strip()]
        if not hosts or any(":" not in h for h in hosts):
            raise ValueError(f"bad addresses for job {job!r}: {addresses!r}; expected host:port")
        cluster[job.strip()] = hosts
    if not cluster:
        raise ValueError("empty --cluster")
    return cluster


def format_cluster(cluster):
    return ";".join(f"{job}={','.join(hosts)}" for job, hosts in cluster.items())


def launch_locally_or_require_tf_config(args, launch_local):
    """launch_local(args)'s outcome under --launch-local; else None once TF_CONFIG is known to be
    set (the task runs itself), or exit saying how to run the example."""
    if args.launch_local:
        return launch_local(args)
    if not os.environ.get("TF_CONFIG"):
        raise SystemExit("set TF_CONFIG (or use --launch-local)")
    return None


def resolve_task(args_cluster, args_job, args_task):
    """(cluster dict, job, task index) from --cluster/--job/--task, else from TF_CONFIG."""
    if args_cluster:
        if args_job is None or args_task is None:
            raise ValueError("--cluster needs --job and --task")
        return parse_cluster(args_cluster), args_job, int(args_task)
    tf_config = os.environ.get("TF_CONFIG")
    if not tf_config:
        raise ValueError("give --cluster/--job/--task or set TF_CONFIG")
    spec = json.loads(tf_config)
    task = spec.get("task", {})
    job = args_job if args_job is not None else task.get("type")
    index = int(args_task if args_task is not None else task.get("index", 0))
    if job is None:
        raise ValueError("TF_CONFIG has no task.type and no --job was given")
    return spec["cluster"], job, index


def rdma_port_offset():
    """tf_rdma listens at each task's server port + TF_RDMA_PORT_OFFSET: that must be free too."""
    try:
        import tf_rdma
        return int(tf_rdma.config.port_offset)
    except (ImportError, AttributeError):
        return int(os.environ.get("TF_RDMA_PORT_OFFSET", "1000"))


def local_cluster(num_ps, num_workers, extra_jobs=(), host="127.0.0.1", transport="grpc"):
    """{'ps': [...], 'worker': [...], ...} on free ports of this host."""
    jobs = [("ps", num_ps), ("worker", num_workers)] + list(extra_jobs)
    offset = rdma_port_offset() if transport == "rdma" else None
    ports = iter(free_ports(sum(n for _, n in jobs), host, also_free_at_offset=offset))
    return {job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in jobs}


# ---------------------------------------------------------------------------------------------
# Machine-readable progress: a child prints one JSON object per line after EVENT_PREFIX.

def emit(enabled, **event):
    if enabled:
        print(EVENT_PREFIX + json.dumps(event), flush=True)


def parse_event(line):
    if line.startswith(EVENT_PREFIX):
        try:
            return json.loads(line[len(EVENT_PREFIX):])
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------------------------------------
# Supervisor.

class ClusterFailed(RuntimeError):
    """A child died, or the cluster made no progress in time. The message says which and why."""


def _die_with_parent():
    # Runs in the child between fork and exec: the kernel SIGKILLs the child if the launcher dies,
    # even by SIGKILL, so no task outlives it.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() == 1:                      # the launcher died before prctl took effect
        os._exit(1)


def raise_on_termination_signals():
    """Ctrl-C raises KeyboardInterrupt (even where a shell started us with SIGINT ignored) and
    SIGTERM/SIGHUP raise SystemExit, so the launcher's `finally:` blocks stop the children."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


@contextlib.contextmanager
def reporting_stops():
    """Around a launcher's runs (inside which `finally:` blocks stop the children): says why it
    stopped; Ctrl-C becomes exit status 130, a termination signal keeps its own."""
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted: every task was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit:
        print("terminated: every task was stopped", file=sys.stderr)
        raise


class _Child:
    def __init__(self, name, popen, log_path, daemon):
        self.name, self.popen, self.log_path, self.daemon = name, popen, log_path, daemon
        self.reader = None
        self.stopping = False

    def describe_exit(self):
        rc = self.popen.returncode
        if rc is not None and rc < 0:
            try:
                return f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"was killed by signal {-rc}"
        return f"exited with code {rc}"

    def log_tail(self, lines=20):
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            return "(no log)"
        return "".join("    | " + l for l in tail).rstrip()


class LocalCluster:
    """Starts processes, relays their events, and turns any death or stall into ClusterFailed.

    Children run in their own session (a Ctrl-C reaches only the launcher, which then stops them),
    die with the launcher (PR_SET_PDEATHSIG), and are terminated, then killed, on `stop()`/exit.
    A child's stdout+stderr go to `<log_dir>/<name>.log`.
    """

    def __init__(self, log_dir, env=None):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.children = {}
        self.events = queue.Queue()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self, name, argv, daemon=False, env=None):
        """Starts `argv`. A daemon (a server that runs until stopped) must not exit on its own while
        the cluster is awaited; a non-daemon must exit with 0. `env` adds variables for this child
        only (e.g. its TF_CONFIG)."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**self.env, **(env or {})}, start_new_session=True, preexec_fn=_die_with_parent,
            text=True, errors="replace", bufsize=1)
        child = _Child(name, popen, log_path, daemon)
        child.reader = threading.Thread(target=self._read, args=(child,), daemon=True)
        child.reader.start()
        self.children[name] = child
        return child

    def _read(self, child):
        with open(child.log_path, "w") as log:
            for line in child.popen.stdout:
                log.write(line)
                log.flush()
                event = parse_event(line)
                if event is not None:
                    self.events.put((child.name, event))
        child.popen.stdout.close()

    def pid(self, name):
        return self.children[name].popen.pid

    def kill(self, name, sig=signal.SIGKILL):
        """Kills one child (used to test failure handling)."""
        child = self.children[name]
        if child.popen.poll() is None:
            os.killpg(child.popen.pid, sig)

    def _failure(self, child, why=None):
        why = why or f"{child.name} (pid {child.popen.pid}) {child.describe_exit()}"
        return ClusterFailed(
            f"{why}. Last lines of {child.log_path}:\n{child.log_tail()}")

    def wait(self, until, timeout, stall_timeout=None, on_event=None):
        """Relays events to on_event(name, event) until every child named in `until` exited with 0.

        Raises ClusterFailed if any child dies (a non-zero exit, or a daemon exiting at all),
        after `timeout` seconds in total, or when no event arrived for `stall_timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        last_event = time.monotonic()
        pending = set(until)
        while True:
            try:
                name, event = self.events.get(timeout=0.2)
                last_event = time.monotonic()
                if on_event is not None:
                    on_event(name, event)
                continue                      # drain events before judging exits
            except queue.Empty:
                pass
            for child in self.children.values():
                if child.stopping or child.popen.poll() is None:
                    continue
                if child.popen.returncode != 0 or child.daemon:
                    child.reader.join(timeout=2)
                    raise self._failure(child)
                if child.name in pending:
                    child.reader.join(timeout=2)
                    if not self.events.empty():
                        break                 # relay its last events first
                    pending.discard(child.name)
            if not pending and self.events.empty():
                return
            now = time.monotonic()
            if now > deadline:
                raise ClusterFailed(
                    f"timed out after {timeout:.0f} s waiting for {', '.join(sorted(pending))}; "
                    f"logs in {self.log_dir}")
            if stall_timeout is not None and now - last_event > stall_timeout:
                raise ClusterFailed(
                    f"no progress from any task for {stall_timeout:.0f} s (waiting for "
                    f"{', '.join(sorted(pending))}); logs in {self.log_dir}")

    def drain(self):
        """Events not relayed yet (e.g. what children printed while being stopped)."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def stop(self, grace=5.0):
        """SIGTERM every child still running, SIGKILL what is left after `grace` seconds."""
        alive = [c for c in self.children.values() if c.popen.poll() is None]
        for child in alive:
            child.stopping = True
            try:
                os.killpg(child.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for child in alive:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.popen.wait()
        for child in self.children.values():
            if child.reader is not None:
                child.reader.join(timeout=2)


def tf_config(cluster, job, index):
    """The TF_CONFIG of one task, as a cluster manager would set it."""
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def serve_until_stopped(transport, cluster, job, task, events):
    """A task that only serves: its server (`server_class(transport)`, TensorFlow's default
    protocol, so tf_rdma's server picks its own) runs until SIGTERM/SIGINT; then, with tf_rdma, it
    reports what tf_rdma carried (printed, and as an `rdma_stats` event) and leaves."""
    make_server = server_class(transport)
    import tensorflow as tf
    server = make_server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task, start=True)
    print(f"{job} {task}: serving at {server.target} ({transport})", flush=True)
    emit(events, kind="serving", job=job, task=task, pid=os.getpid())

    def stop(signum, _frame):
        print(f"{job} {task}: stopping on {signal.Signals(signum).name}", flush=True)
        if transport == "rdma":
            stats = rdma_stats_summary()
            print(f"{job} {task}: tf_rdma stats {stats}", flush=True)
            emit(events, kind="rdma_stats", job=job, task=task, stats=stats)
        # TensorFlow servers cannot be shut down cleanly (GrpcServer::Stop is unimplemented);
        # leave without running destructors.
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:           # server.join() blocks in C++, where no Python signal handler runs
        time.sleep(3600)


def run_local_cluster(transport, start, until, on_event, missing, timeout, log_dir=None,
                      log_prefix="tf_rdma_", out=sys.stdout, stall_timeout=180):
    """A launcher's whole run: `start(lc)` starts the tasks in a LocalCluster, which is awaited
    until the children named in `until` exited (events go to `on_event`) and then stopped.
    `missing()` says what result is missing after that (None when complete). Stops report
    themselves; a failed run keeps its logs (in `log_dir`, else a temporary directory) and says
    where. Returns the events the tasks printed while being stopped, or None if the run failed."""
    import shutil
    import tempfile

    raise_on_termination_signals()
    keep = log_dir or tempfile.mkdtemp(prefix=log_prefix)
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    left = None
    try:
        with reporting_stops():
            with LocalCluster(keep, env) as lc:
                start(lc)
                lc.wait(until=until, timeout=timeout, stall_timeout=stall_timeout,
                        on_event=on_event)
            problem = missing()
            if problem:
                print(f"[{transport}] FAILED: {problem}", file=out)
            else:
                left = lc.drain()
    except ClusterFailed as e:
        print(f"[{transport}] FAILED: {e}", file=out, flush=True)
    finally:
        if left is None:
            print(f"logs kept in {keep}", file=out)
        elif not log_dir:
            shutil.rmtree(keep, ignore_errors=True)
    return left


def python_argv(script, *args):
    return [sys.executable, "-u", script, *map(str, args)]


def rdma_stats_summary():
    """What tf_rdma carried in this process (totals over its peers), or None without tf_rdma."""
    try:
        import tf_rdma
        stats = tf_rdma.stats()
    except Exception:                      # no tf_rdma, or a build without stats
        return None
    peers = stats.get("peers", {})
    keys = ("tensors_sent", "bytes_sent", "tensors_received", "bytes_received", "errors")
    summary = {k: sum(int(p.get(k, 0)) for p in peers.values()) for k in keys}
    summary["backends"] = sorted({str(p.get("backend")) for p in peers.values()})
    summary["left_on_grpc"] = stats.get("fallback", {})
    return summary


def count(value):
    """A stats entry as a number: an int, or the total of a {reason: count} dict."""
    if isinstance(value, dict):
        return sum(v if isinstance(v, int) else 1 for v in value.values())
    return value
