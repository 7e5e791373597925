"""Every TensorFlow the README supports, as its users install tf_rdma: the wheel from the package
index in a venv of its own (tools/tensorflow_versions.py, cached between runs), tf_rdma built into
it with `pip install --no-build-isolation .`, then `info`, a TF1 ps + worker session and a
MultiWorkerMirroredStrategy all-reduce, one over tcp and the other over shm (swapped from one
release to the next), each compared bit for bit with stock gRPC on the same TensorFlow. What
differs between releases is TensorFlow's side, which is the same code for every backend; each
backend's own code has no TensorFlow in it. tensorflow-cpu 2.21.0 is the rest of the suite's own
environment, where all of it runs: it is not built apart (tensorflow 2.21.0 is, the same release
through pip)."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from tests.tf.programs.cluster import PROGRAMS, Cluster, digest
from tools import tensorflow_versions

BACKENDS = ("tcp", "shm")


def backends_of(wheel):
    """(the session's backend, the all-reduce's): each release runs both, swapped release by release."""
    index = tensorflow_versions.BUILT_APART.index(wheel)
    return BACKENDS if index % 2 == 0 else BACKENDS[::-1]


def clean_environment():
    """This checkout's tf_rdma must not shadow the one installed in the venv under test."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TF_RDMA_")}


def session_digest(tmp_path, python, transport, backend=None):
    output = str(tmp_path / f"session-{transport}-{backend}.npz")
    env = {"TF_RDMA_BACKEND": backend} if backend else {}
    with Cluster(tmp_path, {"ps": 1, "worker": 1}, env, python=python, base_env=clean_environment()) as cluster:
        cluster.start("ps", 0, "serve", transport=transport)
        cluster.start("worker", 0, "compare_worker", transport=transport, output=output, big_mib=1)
        assert cluster.wait("worker", 0, timeout=180) == 0, cluster.log("worker", 0)[-4000:] + cluster.log("ps", 0)[-2000:]
    stats = json.loads(Path(output + ".stats.json").read_text()) if transport == "rdma" else None
    return digest(output), stats


def all_reduce_digests(tmp_path, python, transport, backend=None):
    outputs = [str(tmp_path / f"all-reduce-{transport}-{backend}-{i}.npz") for i in range(2)]
    env = {"TF_RDMA_BACKEND": backend} if backend else {}
    with Cluster(tmp_path, {"worker": 2}, env, python=python, base_env=clean_environment()) as cluster:
        for i in range(2):
            cluster.start("worker", i, "all_reduce_worker", program=PROGRAMS / "collective.py",
                          transport=transport, output=outputs[i], steps=2, elements=1 << 16)
        for i in range(2):
            assert cluster.wait("worker", i, timeout=180) == 0, cluster.log("worker", i)[-4000:]
    stats = json.loads(Path(outputs[0] + ".stats.json").read_text()) if transport == "rdma" else None
    return [digest(o) for o in outputs], stats


def carried(stats, backend):
    """Bytes tf_rdma moved over `backend`, to and from every peer."""
    return sum(p["bytes_sent"] + p["bytes_received"] for p in stats["peers"].values() if p["backend"] == backend)


@pytest.mark.timeout(1800)  # a fresh machine downloads the wheel and builds tf_rdma from scratch
@pytest.mark.parametrize("wheel", tensorflow_versions.BUILT_APART)
def test_tf_rdma_installs_and_carries_tensors_on(wheel, tmp_path, matrix_build_id):
    python = str(tensorflow_versions.install_tf_rdma(wheel, matrix_build_id))
    version = wheel.split("==")[1]

    info = subprocess.run([python, "-m", "tf_rdma", "info", "--json"], cwd=tmp_path, env=clean_environment(),
                          capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stdout + info.stderr
    side = json.loads(info.stdout)["tensorflow"]
    assert side["works"] and side["installed"] == side["built_with"] == version, side
    if version.startswith("2.21."):
        assert side["data_transfer_protocol"] == "tf_rdma", side
    else:
        assert side["data_transfer_protocol"] is None, side
        assert "tf_rdma's tf.data service protocol is built for TensorFlow 2.21 only" in \
            side["data_transfer_protocol_why_not"], side

    session_backend, all_reduce_backend = backends_of(wheel)
    reference, _ = session_digest(tmp_path, python, "grpc")
    result, stats = session_digest(tmp_path, python, "rdma", session_backend)
    assert result == reference, f"TF1 session over {session_backend} differs from gRPC on {wheel}"
    assert carried(stats, session_backend) > 1 << 20, stats

    reference, _ = all_reduce_digests(tmp_path, python, "grpc")
    results, stats = all_reduce_digests(tmp_path, python, "rdma", all_reduce_backend)
    assert results == reference, f"all-reduce over {all_reduce_backend} differs from gRPC on {wheel}"
    assert carried(stats, all_reduce_backend) > 0, stats


def test_the_readme_lists_exactly_the_versions_ci_runs():
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- tensorflow-versions -->\n(.*?)<!-- /tensorflow-versions -->", readme, re.S)
    assert table, "the README's support table is delimited by <!-- tensorflow-versions --> comments"
    listed = re.findall(r"^\| `([\w-]+==[\d.]+)` \|", table.group(1), re.M)
    assert listed == tensorflow_versions.SUPPORTED, listed


def test_the_one_release_not_built_apart_is_the_suites_own_environment():
    from importlib import metadata
    name, version = tensorflow_versions.SUITE_ENVIRONMENT.split("==")
    assert tensorflow_versions.SUITE_ENVIRONMENT in (ROOT / "requirements-dev.txt").read_text().split()
    assert metadata.version(name) == version  # what this suite runs on
    assert set(tensorflow_versions.SUPPORTED) - set(tensorflow_versions.BUILT_APART) == {tensorflow_versions.SUITE_ENVIRONMENT}


def test_making_a_venv_deletes_the_least_recently_used_others_until_there_is_room(tmp_path, monkeypatch):
    monkeypatch.setenv("TFRDMA_TEST_VERSIONS_CACHE", str(tmp_path))
    for age, name in enumerate(["old", "recent", "newest"]):
        marker = tmp_path / name / ".tensorflow-installed"
        marker.parent.mkdir()
        (tmp_path / name / "pyvenv.cfg").write_text("")
        marker.write_text(name)
        os.utime(marker, (1000 + age, 1000 + age))
    (tmp_path / "interrupted").mkdir()  # a venv whose install never finished: the first to go
    (tmp_path / "interrupted" / "pyvenv.cfg").write_text("")
    (tmp_path / "ccache").mkdir()  # not a venv: never deleted
    free = {"bytes": tensorflow_versions.VENV_SPACE - 1}

    def disk_usage(path):
        return shutil._ntuple_diskusage(0, 0, free["bytes"])

    def rmtree(path, ignore_errors=False):
        free["bytes"] += tensorflow_versions.VENV_SPACE // 2
        real_rmtree(path)

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    tensorflow_versions.make_room(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ccache", "newest", "old", "recent"]
    free["bytes"] = tensorflow_versions.VENV_SPACE - 1
    tensorflow_versions.make_room(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ccache", "newest", "recent"]
    tensorflow_versions.make_room(tmp_path / "new")  # enough room now: nothing more goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ccache", "newest", "recent"]

    free["bytes"] = 0
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    with pytest.raises(tensorflow_versions.VersionsError, match="MiB free under .*TFRDMA_TEST_VERSIONS_CACHE"):
        tensorflow_versions.make_room(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ccache"]  # all deleted before giving up


def test_a_venv_in_use_is_not_deleted_to_make_room(tmp_path, monkeypatch):
    monkeypatch.setenv("TFRDMA_TEST_VERSIONS_CACHE", str(tmp_path))
    for name in ["used", "unused"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "pyvenv.cfg").write_text("")
    free = {"bytes": 0}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(0, 0, free["bytes"]))
    with tensorflow_versions._locked(tensorflow_versions._lock_of(tmp_path / "used")):
        with pytest.raises(tensorflow_versions.VersionsError):
            tensorflow_versions.make_room(tmp_path / "new")
    assert (tmp_path / "used").exists() and not (tmp_path / "unused").exists()


def test_a_build_prepared_for_the_session_is_used_and_any_other_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("TFRDMA_TEST_VERSIONS_CACHE", str(tmp_path))
    wheel = tensorflow_versions.BUILT_APART[0]
    monkeypatch.setattr(tensorflow_versions, "ensure_venv", lambda w: tensorflow_versions.venv_of(w) / "bin" / "python")
    tensorflow_versions.venv_of(wheel).mkdir()
    builds = []
    monkeypatch.setattr(tensorflow_versions, "_run", lambda command, what, **kwargs: builds.append(what))
    assert tensorflow_versions.prepare([wheel], "session-1") == 0
    tensorflow_versions.install_tf_rdma(wheel, "session-1")
    assert len(builds) == 1  # the prepared build, kept
    tensorflow_versions.install_tf_rdma(wheel, "session-2")
    tensorflow_versions.install_tf_rdma(wheel)
    assert len(builds) == 3, builds  # another session's build, and no session: built again

    def failing(command, what, **kwargs):
        raise tensorflow_versions.VersionsError(f"{what} failed")

    monkeypatch.setattr(tensorflow_versions, "_run", failing)
    assert tensorflow_versions.prepare([wheel], "session-3") == 1  # reported, and left to the test
    assert not (tensorflow_versions.venv_of(wheel) / ".tf_rdma-build").exists()
