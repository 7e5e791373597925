"""Runs in the two linked Soft-RoCE guests (tools/softroce/guest.py run_linked): a TF1 session with
the ps on guest-a and the worker on guest-b, once over gRPC and once over tf_rdma with
TF_RDMA_BACKEND=auto, both at once (each guest imports TensorFlow once per process, and that import
is most of the time). The worker runs tests/tf/programs.py's compare_worker.

usage: tf_across_hosts.py ps|worker PS_IP WORKER_IP BIG_MIB

ps: serves both ps tasks until the worker guest's command has ended (SOFTROCE_SHARED/guest-b.exit),
then prints "RESULT " and the tf_rdma ps's last stats as JSON. worker: runs both workers, prints
"RESULT " and {"grpc": digest, "rdma": digest, "stats": the tf_rdma worker's stats}. Either exits
non-zero with its tasks' logs if a task fails.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TF_TESTS = Path(__file__).resolve().parents[1] / "tf"
sys.path.insert(0, str(TF_TESTS))
from cluster import digest  # noqa: E402

# Fixed ports: each guest is a fresh kernel with nothing else listening. tf_rdma listens at +1000.
PORTS = {"grpc": (2222, 2223), "rdma": (3222, 3223)}
TIMEOUT = float(os.environ.get("TF_ACROSS_HOSTS_TIMEOUT", "900"))


def start(tmp, transport, job, function, spec, **kwargs):
    log = open(tmp / f"{transport}-{job}.log", "w")
    args = json.dumps({"cluster": spec, "job": job, "index": 0, "kwargs": {"transport": transport, **kwargs}})
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="1", TF_RDMA_BACKEND="auto")
    return subprocess.Popen([sys.executable, str(TF_TESTS / "programs.py"), function, args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def logs(tmp):
    return "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in sorted(tmp.glob("*.log")))


def main(role, ps_ip, worker_ip, big_mib):
    tmp = Path(tempfile.mkdtemp())
    specs = {t: {"ps": [f"{ps_ip}:{ps}"], "worker": [f"{worker_ip}:{worker}"]} for t, (ps, worker) in PORTS.items()}
    deadline = time.monotonic() + TIMEOUT
    if role == "ps":
        stats_file = str(tmp / "ps-stats.json")
        tasks = {"grpc": start(tmp, "grpc", "ps", "serve", specs["grpc"]),
                 "rdma": start(tmp, "rdma", "ps", "serve", specs["rdma"], stats_file=stats_file)}
        worker_done = Path(os.environ["SOFTROCE_SHARED"]) / "guest-b.exit"
        while not worker_done.exists():
            failed = {t: p.returncode for t, p in tasks.items() if p.poll() is not None}
            if failed or time.monotonic() > deadline:
                print(f"ps tasks ended or hung before the worker finished: {failed}\n{logs(tmp)}", flush=True)
                return 1
            time.sleep(0.5)
        time.sleep(1)  # one more stats dump (every 0.5 s) after the worker's last step
        for process in tasks.values():
            process.kill()
            process.wait()
        with open(stats_file) as f:
            print("RESULT " + f.read(), flush=True)
        return 0
    outputs = {t: str(tmp / f"{t}.npz") for t in PORTS}
    tasks = {t: start(tmp, t, "worker", "compare_worker", specs[t], output=outputs[t], big_mib=big_mib)
             for t in PORTS}
    for t, process in tasks.items():
        try:
            code = process.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "still running"
        if code != 0:
            print(f"the {t} worker failed ({code})\n{logs(tmp)}", flush=True)
            return 1
    with open(outputs["rdma"] + ".stats.json") as f:
        stats = json.load(f)
    print("RESULT " + json.dumps({"grpc": digest(outputs["grpc"]), "rdma": digest(outputs["rdma"]),
                                  "stats": stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
