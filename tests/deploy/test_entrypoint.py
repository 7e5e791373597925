"""deploy/entrypoint.py: the TF_CONFIG of a StatefulSet pod from its ordinal, and the errors that
name what to fix."""
import json
import os
import subprocess
import sys

import pytest

from tests.deploy.deploy_manifests import DEPLOY, load_entrypoint

entrypoint = load_entrypoint()
POD_ENVIRONMENT = {"POD_NAME": "tf-rdma-1", "POD_NAMESPACE": "ml", "TF_CONFIG_SERVICE": "tf-rdma",
                   "TF_CONFIG_REPLICAS": "3", "TF_CONFIG_PORT": "2222"}


def test_tf_config_names_every_pod_and_this_ones_index():
    assert entrypoint.tf_config("tf-rdma-1", "ml", "tf-rdma", "3", "2222") == {
        "cluster": {"worker": ["tf-rdma-0.tf-rdma.ml.svc:2222", "tf-rdma-1.tf-rdma.ml.svc:2222",
                               "tf-rdma-2.tf-rdma.ml.svc:2222"]},
        "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize("pod_name", ["tf-rdma", "tf-rdma-x", "3"])
def test_a_name_without_an_ordinal_is_refused(pod_name):
    with pytest.raises(entrypoint.EntrypointError, match="POD_NAME"):
        entrypoint.tf_config(pod_name, "ml", "tf-rdma", "3", "2222")


def test_a_pod_beyond_the_replica_count_is_refused():
    with pytest.raises(entrypoint.EntrypointError, match="TF_CONFIG_REPLICAS=3"):
        entrypoint.tf_config("tf-rdma-3", "ml", "tf-rdma", "3", "2222")


def test_a_port_that_is_no_number_is_refused():
    with pytest.raises(entrypoint.EntrypointError, match="TF_CONFIG_PORT"):
        entrypoint.tf_config("tf-rdma-0", "ml", "tf-rdma", "3", "tensorflow")


def run(environment, *command):
    env = {k: v for k, v in os.environ.items() if k not in POD_ENVIRONMENT}
    return subprocess.run([sys.executable, str(DEPLOY / "entrypoint.py"), "--", *command],
                          env={**env, **environment}, capture_output=True, text=True, timeout=60)


def test_the_command_runs_with_tf_config_set():
    result = run(POD_ENVIRONMENT, sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'])")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["task"] == {"type": "worker", "index": 1}


def test_missing_settings_are_named():
    result = run({k: v for k, v in POD_ENVIRONMENT.items() if k != "POD_NAMESPACE"}, "true")
    assert result.returncode == 1
    assert "set POD_NAMESPACE" in result.stderr
