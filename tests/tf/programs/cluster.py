"""Local TensorFlow clusters for the tests: each task a separate process running a function of
tasks.py (or another program of this folder), killed when the test ends."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tf_rdma import ports

PROGRAMS = Path(__file__).parent
TASKS = PROGRAMS / "tasks.py"


def free_ports(count, port_offset=None):
    """`count` ports free now, each with its tf_rdma port (+ TF_RDMA_PORT_OFFSET) free too."""
    if port_offset is None:
        port_offset = int(os.environ.get("TF_RDMA_PORT_OFFSET", "1000"))
    return ports.free_ports(count, also_free_at_offset=port_offset)


def digest(npz_path):
    """One hash over every array's name, dtype, shape and bytes: equal digests, identical results."""
    import hashlib
    import numpy as np
    h = hashlib.sha256()
    with np.load(npz_path) as arrays:
        for name in sorted(arrays.files):
            a = arrays[name]
            h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
    return h.hexdigest()


class Cluster:
    """`jobs`: {"ps": 1, "worker": 1}. Each task runs `tasks.<function>(cluster, job, index, **kw)`."""

    def __init__(self, tmp_path, jobs, env=None, host="localhost", python=sys.executable, base_env=os.environ):
        """`python` and `base_env`: another environment's interpreter (and its variables) runs the tasks."""
        self.env = dict(base_env, TF_CPP_MIN_LOG_LEVEL="1", **(env or {}))
        self.python = python
        ports = iter(free_ports(sum(jobs.values()), int(self.env.get("TF_RDMA_PORT_OFFSET", "1000"))))
        self.spec = {job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in jobs.items()}
        self.tmp_path = tmp_path
        self.processes = {}

    def command(self, job, index, argv):
        """The command line that runs the task's `argv` (a subclass may run it elsewhere)."""
        return argv

    def start(self, job, index, function, env=None, program=TASKS, stdin=None, **kwargs):
        """Runs `function` of `program` (a file with tasks.py's command line) as the task;
        `stdin=subprocess.PIPE` lets the test talk to it."""
        log = open(self.tmp_path / f"{job}{index}.log", "w")
        args = json.dumps({"cluster": self.spec, "job": job, "index": index, "kwargs": kwargs})
        process = subprocess.Popen(self.command(job, index, [self.python, str(program), function, args]),
                                   stdin=stdin, stdout=log, stderr=subprocess.STDOUT,
                                   env={**self.env, **(env or {})})
        self.processes[(job, index)] = process
        return process

    def log(self, job, index):
        return (self.tmp_path / f"{job}{index}.log").read_text()

    def wait(self, job, index, timeout):
        """Exit code of the task, or raises with its log if it does not finish in time."""
        process = self.processes[(job, index)]
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{job}{index} still running after {timeout}s:\n{self.log(job, index)[-3000:]}")

    def wait_for_output(self, job, index, text, timeout):
        """Waits until the task printed `text`; fails with its log if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while text not in self.log(job, index):
            assert time.monotonic() < deadline, self.log(job, index)[-3000:]
            assert self.processes[(job, index)].poll() is None, self.log(job, index)[-3000:]
            time.sleep(0.2)

    def stats_dumped_after(self, path, moment, timeout=30):
        """The stats a task running tasks.serve(stats_file=path) dumped after `moment` (time.time()):
        polls until one was, so it holds everything that happened before."""
        deadline = time.monotonic() + timeout
        while not (os.path.exists(path) and os.stat(path).st_mtime > moment):
            assert time.monotonic() < deadline, f"no stats dumped into {path} within {timeout} s"
            time.sleep(0.1)
        with open(path) as f:
            return json.load(f)

    def signal(self, job, index, sig):
        os.kill(self.processes[(job, index)].pid, sig)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    os.kill(process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                process.kill()
            process.wait()


class NamespacedCluster(Cluster):
    """Cluster whose tasks run in hosts of `net` (tests.harness.netns.Network): each in its own, named
    after the task, or with `one_host`, all in that one (shm's case: a wire between them is not
    shm's)."""

    def __init__(self, tmp_path, net, jobs, env=None, one_host=None):
        super().__init__(tmp_path, jobs, env)
        self.net = net
        self.one_host = one_host
        for job, addresses in self.spec.items():
            for index, address in enumerate(addresses):
                host = self.host(job, index)
                if host not in net.hosts:
                    net.add_host(host)
                addresses[index] = f"{net.address(host)}:{address.rsplit(':', 1)[1]}"

    def host(self, job, index):
        return self.one_host or f"{job}{index}"

    def command(self, job, index, argv):
        return ["ip", "netns", "exec", self.net.namespace(self.host(job, index)), *argv]
