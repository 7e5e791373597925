"""What the deploy/ tests share: the manifests, loaded once, and deploy/entrypoint.py as a module."""
import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Where deploy/Dockerfile puts the repository in the image; the manifests' commands run files there.
IMAGE_SOURCE = "/usr/src/tf_rdma/"


def load_manifests():
    """{(file name, kind, name): document} of every document in deploy/*.yaml."""
    documents = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            documents[(path.name, document["kind"], document["metadata"]["name"])] = document
    return documents


MANIFESTS = load_manifests()


def manifest(kind, name):
    (document,) = [d for (_, k, n), d in MANIFESTS.items() if (k, n) == (kind, name)]
    return document


def pod_templates():
    """[(label, kind, pod template)] of every workload: each TFJob replica type's, each StatefulSet's."""
    templates = []
    for (file, kind, name), document in MANIFESTS.items():
        if kind == "TFJob":
            templates += [(f"{file}:{replica_type}", kind, spec["template"])
                          for replica_type, spec in document["spec"]["tfReplicaSpecs"].items()]
        elif kind == "StatefulSet":
            templates.append((file, kind, document["spec"]["template"]))
    return templates


def load_entrypoint():
    spec = importlib.util.spec_from_file_location("tf_rdma_deploy_entrypoint", DEPLOY / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines tf_config and main, runs nothing
    return module
