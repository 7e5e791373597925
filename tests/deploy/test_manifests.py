"""deploy/'s Kubernetes manifests, checked without a cluster:
- each validates against the Kubernetes API's schemas (kubernetes-validate's bundled ones, offline,
  strict: an unknown field fails), the TFJobs' pod templates as PodTemplateSpecs, and the TFJobs
  themselves against the training operator's API (the kubeflow-training SDK's models);
- every pod carries what tf_rdma needs (RDMA device, IPC_LOCK, the Secret's file, /dev/shm, the
  tf_rdma port), and the environment it gets is one tf_rdma's configuration accepts;
- the TF_CONFIG each task gets (written by the training operator, or by deploy/entrypoint.py for the
  StatefulSet) is read by tf_rdma.Server.from_tf_config() and TensorFlow's TFConfigClusterResolver
  alike, and puts every task's tf_rdma listener at the port the manifests open: its TensorFlow
  port + TF_RDMA_PORT_OFFSET. No server starts: the names are the cluster's, not this host's.
"""
import copy
import json
import os
import posixpath
import subprocess
import sys

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import tensorflow as tf
from kubeflow.training import ApiClient
from kubeflow.training.constants import constants as kubeflow
from kubeflow.training.utils.utils import FakeResponse
from kubernetes.utils import parse_quantity
from packaging.version import Version

import tf_rdma
from tests.deploy.deploy_manifests import MANIFESTS, load_entrypoint, manifest, pod_templates
from tf_rdma.config import load_config
from tf_rdma.errors import ConfigError

BUILT_IN_KINDS = {"Service", "StatefulSet", "Secret"}
_BUNDLED = sorted(set(kubernetes_validate.utils.all_versions()), key=Version)
KUBERNETES_VERSIONS = (_BUNDLED[0], _BUNDLED[-1])  # the oldest and the newest the validator knows
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
PORT_OFFSET = load_config({}).port_offset  # TF_RDMA_PORT_OFFSET's default: the manifests leave it unset
NAMESPACE = "default"  # the manifests name none: they go where they are applied
# The port names the TensorFlow port goes by: the operator's (it reads the port by this name), and
# the StatefulSet's own.
TENSORFLOW_PORT_NAMES = {"TFJob": "tfjob-port", "StatefulSet": "tensorflow"}


def _id(key):
    return "/".join(key)


POD_TEMPLATES = [pytest.param(*t, id=t[0]) for t in pod_templates()]


def test_every_manifest_is_of_a_kind_validated_here():
    assert {kind for _, kind, _ in MANIFESTS} <= BUILT_IN_KINDS | {kubeflow.TFJOB_KIND}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("key", [k for k in MANIFESTS if k[1] in BUILT_IN_KINDS], ids=_id)
def test_built_in_kinds_validate(key, version):
    kubernetes_validate.validate(MANIFESTS[key], version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("label, kind, template", POD_TEMPLATES)
def test_pod_templates_validate(label, kind, template, version):
    # A TFJob's pod templates are core/v1 PodTemplateSpecs, which the Kubernetes schemas hold as
    # the `template` of the built-in kind PodTemplate.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": template}, version, strict=True)


def tfjob_envelope(tfjob):
    """The TFJob without its pod templates, which test_pod_templates_validate checks."""
    envelope = copy.deepcopy(tfjob)
    for spec in envelope["spec"]["tfReplicaSpecs"].values():
        spec.pop("template")
    return envelope


def _differences(expected, got, path=""):
    if isinstance(expected, dict) and isinstance(got, dict):
        return [d for key in sorted(set(expected) | set(got))
                for d in _differences(expected.get(key), got.get(key), f"{path}.{key}")]
    return [] if expected == got else [f"{path}: {expected!r} became {got!r}"]


def tfjob_api_problems(tfjob):
    """Why the training operator's API (the kubeflow-training SDK's models of kubeflow.org/v1)
    would not take the TFJob's envelope as written, [] if it would: the SDK reads a TFJob as its own
    client does, refusing missing required fields, and dropping or converting every field the API
    does not have or types otherwise, which the comparison with what it writes back shows."""
    if (tfjob.get("apiVersion"), tfjob.get("kind")) != (kubeflow.API_VERSION, kubeflow.TFJOB_KIND):
        return [f"not a {kubeflow.API_VERSION} {kubeflow.TFJOB_KIND}"]
    envelope = tfjob_envelope(tfjob)
    client = ApiClient()
    try:
        job = client.deserialize(FakeResponse(envelope), kubeflow.TFJOB_MODEL)
    except (ValueError, TypeError) as e:
        return [str(e)]
    problems = _differences(envelope, client.sanitize_for_serialization(job))
    return problems + [f"replica type {t} is none of the operator's {kubeflow.TFJOB_REPLICA_TYPES}"
                       for t in tfjob["spec"]["tfReplicaSpecs"] if t.lower() not in kubeflow.TFJOB_REPLICA_TYPES]


TFJOBS = [k for k in MANIFESTS if k[1] == kubeflow.TFJOB_KIND]


@pytest.mark.parametrize("key", TFJOBS, ids=_id)
def test_tfjobs_match_the_training_operators_api(key):
    assert tfjob_api_problems(MANIFESTS[key]) == []


def _misspelled_field(job):
    job["spec"]["runPolicy"]["cleanPodPolicies"] = job["spec"]["runPolicy"].pop("cleanPodPolicy")


def _replicas_as_text(job):
    job["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "2"


def _no_run_policy(job):
    del job["spec"]["runPolicy"]


def _unknown_replica_type(job):
    job["spec"]["tfReplicaSpecs"]["Coordinator"] = job["spec"]["tfReplicaSpecs"].pop("Chief")


@pytest.mark.parametrize("damage", [_misspelled_field, _replicas_as_text, _no_run_policy, _unknown_replica_type])
def test_the_tfjob_check_catches_what_the_operator_would_refuse(damage):
    job = copy.deepcopy(manifest(kubeflow.TFJOB_KIND, "tf-rdma-ps"))
    damage(job)
    assert tfjob_api_problems(job)


def test_strict_validation_catches_an_unknown_container_field():
    (label, _, template), *_ = pod_templates()
    template = copy.deepcopy(template)
    template["spec"]["containers"][0]["capabilities"] = ["IPC_LOCK"]  # belongs in securityContext
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, KUBERNETES_VERSIONS[-1], strict=True)


def tensorflow_container(template):
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == kubeflow.TFJOB_CONTAINER]
    return container


def ports(template):
    return {p["name"]: p["containerPort"] for p in tensorflow_container(template)["ports"]}


@pytest.mark.parametrize("label, kind, template", POD_TEMPLATES)
def test_every_pod_has_what_tf_rdma_needs(label, kind, template):
    container = tensorflow_container(template)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TF_RDMA_BACKEND"] == "auto"
    limits = container["resources"]["limits"]
    assert limits[RDMA_RESOURCE] == 1
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    # TF_RDMA_SECRET_FILE is a key of the Secret, mounted as a file of that name.
    folder, key = posixpath.split(env["TF_RDMA_SECRET_FILE"])
    secret_volume = mounted[folder]["secret"]
    assert "items" not in secret_volume
    assert key in manifest("Secret", secret_volume["secretName"])["stringData"]
    shm = mounted["/dev/shm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    # A memory-backed emptyDir counts against the container's memory limit.
    assert parse_quantity(shm["sizeLimit"]) < parse_quantity(limits["memory"])
    opened = ports(template)
    assert opened["tf-rdma"] == opened[TENSORFLOW_PORT_NAMES[kind]] + PORT_OFFSET


@pytest.fixture(scope="module")
def generated_secret():
    # What deploy/README.md tells users to put in the Secret, made the same way.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    result = subprocess.run([sys.executable, "-m", "tf_rdma", "secret"], env=env, capture_output=True,
                            text=True, check=True)
    return result.stdout.strip()


def pod_tf_rdma_environment(template, secret_file):
    env = {e["name"]: e["value"] for e in tensorflow_container(template)["env"]
           if e["name"].startswith("TF_RDMA_")}
    env["TF_RDMA_SECRET_FILE"] = str(secret_file)  # the mounted Secret's file, here
    return env


@pytest.mark.parametrize("label, kind, template", POD_TEMPLATES)
def test_every_pods_tf_rdma_environment_loads(label, kind, template, generated_secret, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(generated_secret + "\n")  # as `kubectl create secret --from-file` of a saved line
    config = load_config(pod_tf_rdma_environment(template, secret_file))
    assert config.backend == "auto"
    assert config.secret == generated_secret.encode()


def test_the_secrets_placeholder_is_refused(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(manifest("Secret", "tf-rdma-secret")["stringData"]["secret"])
    (_, _, template), *_ = pod_templates()
    with pytest.raises(ConfigError, match="too weak"):
        load_config(pod_tf_rdma_environment(template, secret_file))


def operator_tf_configs(tfjob):
    """{(task type, index): TF_CONFIG} as the training operator writes them into the TFJob's pods:
    every replica type but Evaluator in the cluster, lower-cased, each replica at its headless
    Service <job>-<type>-<index>.<namespace>.svc and the port named tfjob-port of the container
    named tensorflow, with "environment": "cloud"."""
    name = tfjob["metadata"]["name"]
    cluster = {}
    for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        if replica_type != "Evaluator":
            task_type = replica_type.lower()
            port = ports(spec["template"])["tfjob-port"]
            cluster[task_type] = [f"{name}-{task_type}-{i}.{NAMESPACE}.svc:{port}" for i in range(spec["replicas"])]
    return {(task_type, index): json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index},
                                            "environment": "cloud"})
            for task_type, hosts in cluster.items() for index in range(len(hosts))}


def statefulset_tf_configs(statefulset):
    """{("worker", ordinal): TF_CONFIG} as deploy/entrypoint.py writes them into the pods."""
    service = manifest("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # each pod's own DNS name
    template = statefulset["spec"]["template"]
    env = {e["name"]: e.get("value") for e in tensorflow_container(template)["env"]}
    assert int(env["TF_CONFIG_REPLICAS"]) == statefulset["spec"]["replicas"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports(template)
    entrypoint = load_entrypoint()
    configs = {}
    for ordinal in range(statefulset["spec"]["replicas"]):
        config = entrypoint.tf_config(f"{statefulset['metadata']['name']}-{ordinal}", NAMESPACE,
                                      env["TF_CONFIG_SERVICE"], env["TF_CONFIG_REPLICAS"], env["TF_CONFIG_PORT"])
        configs[(config["task"]["type"], config["task"]["index"])] = json.dumps(config)
    return configs


class ParsedServer(tf_rdma.Server):
    """What Server.from_tf_config() would build, recorded instead of started."""

    def __init__(self, cluster, job_name=None, task_index=None, **kwargs):
        self.cluster, self.job_name, self.task_index = cluster, job_name, task_index


CLUSTERS = {"tfjob-ps": (kubeflow.TFJOB_KIND, "tf-rdma-ps"), "tfjob-mwms": (kubeflow.TFJOB_KIND, "tf-rdma-mwms"),
            "statefulset": ("StatefulSet", "tf-rdma")}
# The shapes deploy/README.md describes: the chief is ParameterServerStrategy's coordinator.
EXPECTED_JOBS = {"tfjob-ps": {"chief": 1, "ps": 1, "worker": 2}, "tfjob-mwms": {"worker": 2},
                 "statefulset": {"worker": 2}}


def cluster_of(kind, name):
    """({(task type, index): TF_CONFIG}, {task type: pod template}) of the workload."""
    document = manifest(kind, name)
    if kind == kubeflow.TFJOB_KIND:
        return operator_tf_configs(document), {replica_type.lower(): spec["template"]
                                               for replica_type, spec in document["spec"]["tfReplicaSpecs"].items()}
    return statefulset_tf_configs(document), {"worker": document["spec"]["template"]}


@pytest.mark.parametrize("cluster_name", CLUSTERS)
def test_each_tasks_tf_config_gives_tf_rdma_the_ports_the_manifests_open(cluster_name, monkeypatch):
    configs, templates = cluster_of(*CLUSTERS[cluster_name])
    jobs = {}
    for task_type, index in configs:
        jobs[task_type] = jobs.get(task_type, 0) + 1
    assert jobs == EXPECTED_JOBS[cluster_name]
    for (task_type, index), text in configs.items():
        server = ParsedServer.from_tf_config(text)
        assert (server.job_name, server.task_index) == (task_type, index)
        # What the strategies read (the chief's ParameterServerStrategy, MultiWorkerMirroredStrategy).
        monkeypatch.setenv("TF_CONFIG", text)
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert (resolver.task_type, resolver.task_id) == (task_type, index)
        assert resolver.cluster_spec().as_dict() == server.cluster.as_dict()
        for task, host, tensorflow_port, rdma_port in tf_rdma.server.cluster_tasks(server.cluster):
            job = task.split("/")[1][len("job:"):]
            assert host.endswith(f".{NAMESPACE}.svc")
            assert rdma_port == tensorflow_port + PORT_OFFSET == ports(templates[job])["tf-rdma"], task
