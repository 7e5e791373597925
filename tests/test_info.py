"""`python -m tf_rdma info`, as the README's install section has users run it: backends, RDMA
devices, the locked-memory limit and the configuration in effect, without revealing the secret."""
import json
import os
import resource
import secrets
import subprocess
import sys
from pathlib import Path

from tf_rdma import _transport

SECRET = "not-for-printing-" + secrets.token_urlsafe(32)


def run_info(*args, secret=SECRET, **env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    env.update(TF_RDMA_PEER_TIMEOUT_MS="1234", TF_RDMA_BACKEND="tcp", **env_overrides)
    if secret is not None:
        env["TF_RDMA_SECRET"] = secret
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "info", *args], env=env,
                            capture_output=True, text=True, timeout=120)
    assert SECRET not in result.stdout + result.stderr
    return result


def info(*args, secret=SECRET):
    result = run_info(*args, secret=secret)
    assert result.returncode == 0, result.stderr
    return result.stdout


def kib(limit):
    return "unlimited" if limit == resource.RLIM_INFINITY else f"{limit // 1024} KiB"


def test_info_says_what_this_host_offers_and_the_configuration_in_effect():
    text = info()
    for backend, _ in _transport.backends():
        usable, why_not = _transport.backend_available(backend)
        assert f"  {backend:6} {'available' if usable else 'unavailable: ' + why_not}\n" in text, text
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    if devices:
        assert all(f"  {name}: port " in text for name in devices), text
    else:
        assert "RDMA devices: none" in text, text
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert f"locked memory limit (ulimit -l): {kib(soft)} (hard {kib(hard)})" in text, text
    assert "  backend = tcp\n" in text and "  peer_timeout = 1.234\n" in text, text
    assert "  secret = (set)\n" in text, text


def test_info_as_json_names_the_variables_set_and_hides_the_secret():
    report = json.loads(info("--json"))
    assert report["config"]["peer_timeout"] == 1.234 and report["config"]["secret"] == "(set)", report
    assert report["environment"] == {"TF_RDMA_PEER_TIMEOUT_MS": "1234", "TF_RDMA_BACKEND": "tcp",
                                     "TF_RDMA_SECRET": "(set)"}, report
    assert report["backends"]["tcp"] is None and report["wire_protocol"] == _transport.PROTOCOL_VERSION


def test_info_warns_when_no_secret_keeps_strangers_out():
    assert "warning: TF_RDMA_SECRET is not set" in info(secret=None)
    assert "warning: TF_RDMA_SECRET" not in info()


def test_info_loads_the_tensorflow_side_and_says_what_it_was_built_with():
    import tensorflow as tf
    text = info()
    assert "TensorFlow side: works\n" in text, text
    assert f"built against TensorFlow {tf.__version__} with {_transport.COMPILER}; installed: {tf.__version__}" \
        in text, text
    side = json.loads(info("--json"))["tensorflow"]
    assert side["works"] and side["built_with"] == side["installed"] == tf.__version__, side
    assert side["data_transfer_protocol"] == "tf_rdma" and "  tf.data service protocol: tf_rdma\n" in text, side


def test_info_says_the_tensorflow_side_is_broken_and_why_and_exits_1(tmp_path):
    # Another TensorFlow than the one built against (here a stand-in package that shadows it).
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.99.0"\n')
    result = run_info(PYTHONPATH=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (f"TensorFlow side: BROKEN: TensorFlowMismatchError: tf_rdma was built against TensorFlow "
            f"{_transport.BUILT_WITH_TENSORFLOW}, and this process runs TensorFlow 2.99.0: rebuild tf_rdma "
            "against it") in result.stdout, result.stdout
