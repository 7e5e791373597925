"""What the soak and chaos runs share: their tasks as processes whose prefixed lines are read, the
resources sampled from each process, and the judgement of whether those stayed flat."""
import json
import os
import queue
import signal
import tempfile
import threading

from tf_rdma.bench._common import start_task

SETTLE = 3  # samples whose lowest stands for a moment, so one sample taken mid-step cannot decide
# glibc raises its mmap threshold as big blocks are freed, after which freed tensors stay in
# fragmented heaps and RSS creeps up with no leak (measured: about 1 MiB per cancelled step, flat
# with the threshold fixed). Fixed, a freed tensor goes back to the system and RSS shows what
# the process holds.
TASK_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


class TooFewSamples(RuntimeError):
    """A run too short (or too slowed down) for its flatness to be judged."""


def process_sample(pid):
    """RSS, open descriptors, threads and shared-memory bytes mapped, from /proc/PID."""
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    mapped = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/memfd:"):
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                mapped += stop - start
    return {"rss_bytes": rss_kib << 10, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task")), "mapped_shm_bytes": mapped}


def judge(samples, warmup_samples, bounds, processes, settle=SETTLE):
    """{process: {quantity: {"baseline", "end", "growth", "bound", "flat"}}} over the samples after
    warm-up: baseline is the lowest of the first `settle` of them, end the lowest of the last."""
    after = samples[warmup_samples:]
    if len(after) < 2 * settle:
        raise TooFewSamples(f"{len(after)} samples after warm-up; flatness needs at least {2 * settle}: "
                            "run longer (--minutes)")
    verdict = {}
    for process in processes:
        verdict[process] = {}
        for quantity, bound in bounds.items():
            values = [s[process][quantity] for s in after]
            baseline = min(values[:settle])
            end = min(values[-settle:])
            verdict[process][quantity] = {"baseline": baseline, "end": end, "growth": end - baseline,
                                          "bound": bound, "flat": end - baseline <= bound}
    return verdict


class Task:
    """A task's process, its stdout lines on a queue (read by a thread so a pipe never fills), its
    stderr in a file for the error message when it fails (`stderr`, or a temporary one). `module`,
    `env` and `prefix`: tf_rdma.bench._common.start_task's."""

    def __init__(self, spec, module, env=TASK_ENVIRONMENT, prefix=(), stderr=None):
        self.stderr = stderr or tempfile.TemporaryFile("w+")
        self.process = start_task(module, spec, stderr=self.stderr, env=env, prefix=prefix)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def latest(self, prefix):
        """The last line with `prefix` read so far, decoded; None if none came since last asked."""
        found = None
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return found
            if line and line.startswith(prefix):
                found = json.loads(line[len(prefix):])

    def error_tail(self):
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process dies of SIGKILL only once resumed
            self.process.kill()
        self.process.wait()
        self.stderr.close()
