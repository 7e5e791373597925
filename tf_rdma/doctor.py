"""`python -m tf_rdma doctor`: checks a running cluster from one of its hosts, before (or instead
of) a training step finding out. For every task of the cluster (TF_CONFIG's, or --cluster-spec):
its gRPC and tf_rdma ports answer, it completes tf_rdma's handshake with this process (which proves
that both hold the same secret without sending it: each side shows it can compute a MAC keyed by
it) under its own task name, the wire protocol it speaks, its tf_rdma build and the TensorFlow that build was made for, and the backend this host would use to reach it
and why; and on this host, the locked-memory limit against what verbs would register."""
import concurrent.futures
import dataclasses
import json
import os
import socket
from typing import Optional

from tf_rdma import _transport, errors
from tf_rdma.config import load_config
from tf_rdma.transport import available_backends

# The name this process gives itself in the handshake: not a task name, so a task proves its name
# and key to it and then refuses the connection. A task name would be taken, by every task whose
# name sorts after it, for a peer that connects: adopted, and counted in its stats.
DOCTOR_NAME = "tf_rdma doctor"
# Tasks checked at once: an unreachable one costs a few seconds of timeouts.
PARALLEL_CHECKS = 32
HANDSHAKE_TIMEOUT_S = 5.0


@dataclasses.dataclass
class TaskReport:
    task: str
    address: str          # host:tf_rdma port
    grpc_answers: bool
    tf_rdma_answers: bool
    same_secret: Optional[bool] = None   # None: not known (no handshake got that far)
    wire: str = ""
    build: str = ""
    backend: str = ""
    backend_reason: str = ""
    problems: list = dataclasses.field(default_factory=list)


def cluster_from(cluster_spec=None, environ=None):
    """The cluster (dict of job -> addresses) from --cluster-spec's JSON, else from TF_CONFIG."""
    environ = os.environ if environ is None else environ
    if cluster_spec:
        try:
            return json.loads(cluster_spec)
        except ValueError as e:
            raise errors.ConfigError(f"--cluster-spec is not JSON ({e}); give e.g. "
                                     '\'{"ps": ["ps0:2222"], "worker": ["w0:2222"]}\'') from e
    text = environ.get("TF_CONFIG")
    if not text:
        raise errors.ConfigError("no cluster to check: set TF_CONFIG (as every task of the cluster has it) "
                                 "or give --cluster-spec")
    try:
        return json.loads(text)["cluster"]
    except (ValueError, KeyError, TypeError) as e:
        raise errors.ConfigError(f"TF_CONFIG is not a valid cluster description: {e}") from e


def _answers(host, port, timeout=2.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _handshake(report, transport, host, rdma_port):
    """Completes tf_rdma's handshake with the task over tcp (every task listens there, whatever
    its backend), filling what it proves into `report`."""
    try:
        connection = transport.connect(f"{host}:{rdma_port}")
    except errors.HandshakeError as e:
        text = str(e)
        if "cluster key mismatch" not in text:
            report.problems.append(text)  # another wire protocol, a refusal: the text names it and the fix
        else:
            report.same_secret = False
            report.problems.append(
                f"it holds another secret than this process ({text}). Give every task the same "
                "TF_RDMA_SECRET or TF_RDMA_SECRET_FILE.")
        return
    except errors.TransportError as e:
        report.problems.append(f"tf_rdma's handshake with it failed: {type(e).__name__}: {e}")
        return
    report.same_secret = True
    report.wire = str(_transport.PROTOCOL_VERSION)  # the handshake succeeds only on the same one
    report.build = connection.peer_build  # its tf_rdma and the TensorFlow it was built against
    # The name is what the peer proved along with the key: the task's own, or whoever answers there
    # is not that task (tasks would take its tensors for another's, or not connect to it at all).
    if connection.peer_name != report.task:
        report.problems.append(
            f"the tf_rdma listener at {report.address} answers as {connection.peer_name}, not as {report.task}: "
            "another process holding the secret listens at this task's address (a squatter), or that "
            "server was started under another job name or task index than this cluster spec gives it")
    connection.close("tf_rdma doctor is done")


def check_task(transport, task, host, grpc_port, rdma_port):
    """What `transport` (tcp, named DOCTOR_NAME, holding this process's cluster key) learns of one task."""
    report = TaskReport(task=task, address=f"{host}:{rdma_port}", grpc_answers=_answers(host, grpc_port),
                        tf_rdma_answers=_answers(host, rdma_port))
    if not report.tf_rdma_answers:
        if report.grpc_answers:
            report.problems.append(
                f"its TensorFlow port {grpc_port} answers but nothing listens on its tf_rdma port {rdma_port}: "
                "it runs TensorFlow without tf_rdma (use tf_rdma.Server / tf_rdma's strategies there), or "
                "with another TF_RDMA_PORT_OFFSET or rdma_addresses than this process")
        else:
            report.problems.append(
                f"nothing answers at {host}:{grpc_port} (TensorFlow) nor at {host}:{rdma_port} (tf_rdma): "
                "the task is not running, or a firewall or network policy drops both ports")
        return report
    _handshake(report, transport, host, rdma_port)
    try:
        report.backend, report.backend_reason = _transport.choose_backend(load_config().backend, host)
    except errors.TransportError as e:
        report.problems.append(f"no backend of this host reaches it: {e}")
    return report


def _has_cap_ipc_lock():
    """CAP_IPC_LOCK (bit 14 of the effective set) lets verbs register past `ulimit -l`."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    except OSError:
        pass
    return False


def memlock_check(peers, slab_bytes):
    """Whether `ulimit -l` lets verbs register the receive pools of `peers` peers, if verbs is used."""
    config = load_config()
    verbs_usable = available_backends()["verbs"] is None
    if config.backend not in ("verbs", "auto") or (config.backend == "auto" and not verbs_usable):
        return {"applies": False, "why": f"verbs is not used here (TF_RDMA_BACKEND={config.backend}"
                                         f"{'' if verbs_usable else ', and verbs is unavailable'})"}
    soft, _ = _transport.memlock_limit()
    if _has_cap_ipc_lock():
        soft = -1  # the limit does not apply to this process
    least, most = peers * slab_bytes[0], peers * slab_bytes[1]
    result = {"applies": True, "limit": "unlimited" if soft < 0 else soft, "least": least, "most": most}
    fix = ("raise it: `ulimit -l unlimited`, LimitMEMLOCK=infinity for systemd, `--ulimit memlock=-1` for "
           "docker, or the IPC_LOCK capability in Kubernetes (deploy/)")
    if soft >= 0 and soft < least:
        result["problem"] = (f"ulimit -l is {soft // 1024} KiB and verbs registers at least {least >> 20} MiB "
                             f"here (a 1 MiB receive pool per peer, {peers} peers): {fix}")
    elif soft >= 0 and soft < most:
        result["warning"] = (f"ulimit -l is {soft // 1024} KiB: enough for verbs' first receive pools "
                             f"({least >> 20} MiB), not for tensors that grow them to {most >> 20} MiB; {fix}")
    if config.backend == "verbs" and not verbs_usable:
        result["problem"] = (result.get("problem", "") + "; " if "problem" in result else "") + \
            f"TF_RDMA_BACKEND=verbs but verbs is unavailable here: {available_backends()['verbs']}"
    return result


def run(cluster, rdma_addresses=None):
    """{"tasks": [...], "memlock": {...}, "healthy": bool} for `cluster`."""
    from tf_rdma import server  # TensorFlow: the task addresses, as servers derive them
    tasks = server.cluster_tasks(cluster, rdma_addresses)
    transport = _transport.Transport("tcp", name=DOCTOR_NAME, cluster_key=load_config().cluster_key(),
                                     connect_timeout=HANDSHAKE_TIMEOUT_S, peer_timeout=HANDSHAKE_TIMEOUT_S)
    with concurrent.futures.ThreadPoolExecutor(min(PARALLEL_CHECKS, max(len(tasks), 1))) as pool:
        reports = list(pool.map(lambda task: check_task(transport, *task), tasks))
    memlock = memlock_check(len(tasks), server.receive_pool_slab_bytes())
    return {"tasks": [dataclasses.asdict(r) for r in reports], "memlock": memlock,
            "healthy": all(not r.problems for r in reports) and "problem" not in memlock}


def render(result):
    def mark(value):
        return {True: "yes", False: "NO", None: "?"}[value]
    rows = [("task", "tf_rdma address", "gRPC", "tf_rdma", "same secret", "wire", "tf_rdma build",
             "backend from here")]
    for t in result["tasks"]:
        rows.append((t["task"], t["address"], mark(t["grpc_answers"]), mark(t["tf_rdma_answers"]),
                     mark(t["same_secret"]), t["wire"] or "-", t["build"] or "-",
                     f"{t['backend']} ({t['backend_reason']})" if t["backend"] else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    memlock = result["memlock"]
    lines.append("")
    if memlock["applies"]:
        limit = memlock["limit"]
        lines.append(f"locked memory: {'unlimited' if limit == 'unlimited' else str(limit // 1024) + ' KiB'}; "
                     f"verbs registers {memlock['least'] >> 20}-{memlock['most'] >> 20} MiB for this cluster")
    else:
        lines.append(f"locked memory: not checked, {memlock['why']}")
    problems = [(t["task"], p) for t in result["tasks"] for p in t["problems"]]
    if "problem" in memlock:
        problems.append(("this host", memlock["problem"]))
    if "warning" in memlock:
        lines.append(f"warning: {memlock['warning']}")
    lines.append("")
    lines.append("healthy" if result["healthy"] else f"{len(problems)} problem(s):")
    lines += [f"  {who}: {what}" for who, what in problems]
    return "\n".join(lines)
