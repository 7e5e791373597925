"""What this host offers tf_rdma: backends, RDMA devices, and the limits that break registration."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tf_rdma import _transport
from tf_rdma.config import load_config, settings
from tf_rdma.transport import available_backends


def rdma_devices():
    """RDMA devices the kernel exposes, with their ports' states (empty without kernel RDMA)."""
    root = Path("/sys/class/infiniband")
    devices = []
    for device in sorted(root.iterdir()) if root.is_dir() else []:
        ports = {}
        for port in sorted((device / "ports").iterdir()) if (device / "ports").is_dir() else []:
            state = (port / "state").read_text().strip() if (port / "state").exists() else "?"
            link = (port / "link_layer").read_text().strip() if (port / "link_layer").exists() else "?"
            ports[port.name] = f"{state} ({link})"
        devices.append({"name": device.name, "ports": ports})
    return devices


def _limit(value):
    return "unlimited" if value < 0 else f"{value // 1024} KiB"


def _hidden(secret):
    return "(set)" if secret else "(empty)"


# Run in a child: a TensorFlow side that cannot load (an undefined symbol, another TensorFlow) is
# reported, and one that crashed while loading would not take `info` down with it.
_TENSORFLOW_SIDE_PROBE = """
import json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
report = {"installed": tf.__version__}
try:
    from tf_rdma import server
    report["protocol"] = server.protocol()
    try:
        report["data_transfer_protocol"] = server.data_transfer_protocol()
    except server.ConfigError as e:  # built for other TensorFlow releases only: says which
        report["data_transfer_protocol"] = None
        report["data_transfer_protocol_why_not"] = str(e)
except Exception as e:
    report["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(report))
"""


def tensorflow_side():
    """Whether tf_rdma's TensorFlow side loads into the TensorFlow here, and what it was built with."""
    report = {"built_with": _transport.BUILT_WITH_TENSORFLOW, "compiler": _transport.COMPILER,
              "installed": None, "works": False}
    result = subprocess.run([sys.executable, "-c", _TENSORFLOW_SIDE_PROBE], capture_output=True, text=True,
                            timeout=300)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        errors = result.stderr.strip().splitlines()
        report["error"] = (errors[-1] if errors else f"the probe exited with {result.returncode}")
        if "No module named 'tensorflow'" in report["error"]:
            report["error"] = "TensorFlow is not installed in this environment"
        return report
    report.update(json.loads(lines[-1]))
    report["works"] = "error" not in report
    return report


def collect():
    soft, hard = _transport.memlock_limit()
    return {
        "version": _transport.BUILD_VERSION,
        "tensorflow": tensorflow_side(),
        "wire_protocol": _transport.PROTOCOL_VERSION,
        "backends": available_backends(),
        "rdma_devices": rdma_devices(),
        "memlock_limit": {"soft": _limit(soft), "hard": _limit(hard)},
        "config": {k: (v if k != "secret" else _hidden(v)) for k, v in vars(load_config()).items()},
        # The variables set, as set; the secret's value never leaves the process.
        "environment": {s.name: (os.environ[s.name] if s.name != "TF_RDMA_SECRET" else _hidden(os.environ[s.name]))
                        for s in settings() if s.name in os.environ},
    }


def render(info):
    lines = [f"tf_rdma {info['version']} (wire protocol {info['wire_protocol']})", ""]
    tf_side = info["tensorflow"]
    lines.append(f"TensorFlow side: {'works' if tf_side['works'] else 'BROKEN: ' + tf_side['error']}")
    lines.append(f"  built against TensorFlow {tf_side['built_with']} with {tf_side['compiler']}; "
                 f"installed: {tf_side['installed'] or 'none'}")
    if tf_side["works"]:
        lines.append(f"  tf.data service protocol: {tf_side['data_transfer_protocol'] or 'unavailable: '}"
                     f"{tf_side.get('data_transfer_protocol_why_not', '')}")
    lines += ["", "backends:"]
    for name, reason in info["backends"].items():
        lines.append(f"  {name:6} {'available' if reason is None else 'unavailable: ' + reason}")
    lines.append("")
    lines.append("RDMA devices:" if info["rdma_devices"] else
                 "RDMA devices: none (/sys/class/infiniband is empty or absent)")
    for device in info["rdma_devices"]:
        ports = ", ".join(f"port {p}: {s}" for p, s in device["ports"].items()) or "no ports"
        lines.append(f"  {device['name']}: {ports}")
    memlock = info["memlock_limit"]
    lines += ["", f"locked memory limit (ulimit -l): {memlock['soft']} (hard {memlock['hard']})"]
    if memlock["soft"] != "unlimited":
        lines.append("  verbs registers its receive pools: raise it with `ulimit -l unlimited` "
                     "(or memlock in /etc/security/limits.conf) on RDMA hosts")
    if info["config"]["secret"] == _hidden(b""):
        lines += ["", "warning: TF_RDMA_SECRET is not set: anyone who reaches a tf_rdma port can join the "
                      "cluster. Set the same secret in every task on a network you do not control."]
    lines += ["", "configuration:"]
    lines += [f"  {k} = {v}" for k, v in info["config"].items()]
    return "\n".join(lines)
