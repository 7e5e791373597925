"""setup.py's check of the target environment's TensorFlow: it finds it even under pip's build
isolation, and without TensorFlow, or with one older than 2.16, it stops saying what to install.
The interpreters here are small wrappers around this one, so no other Python is needed."""
import importlib.util
import stat
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_py(monkeypatch):
    spec = importlib.util.spec_from_file_location("tf_rdma_setup_py", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the checks, builds nothing
    module.installed_tensorflow.cache_clear()
    return module


def interpreter(tmp_path, *options, environment=""):
    """An executable that runs this Python with `options` (after `environment` shell exports)."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{environment}\nexec {sys.executable} {' '.join(options)} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_tensorflow_is_found_under_pips_build_isolation(setup_py, tmp_path, monkeypatch):
    # What pip's isolated build does to the environment: PYTHONNOUSERSITE, and PYTHONPATH with a
    # sitecustomize that takes the environment's site-packages off sys.path.
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        sys.path[:] = [p for p in sys.path if "site-packages" not in p]
    """))
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    monkeypatch.setenv("PYTHONPATH", str(overlay))
    isolated = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, text=True)
    assert isolated.returncode != 0, "the isolation this test builds must hide TensorFlow"
    info = setup_py.installed_tensorflow()
    assert Path(info["lib"]).is_relative_to(sysconfig.get_paths()["purelib"]), info
    assert any(flag.startswith("-I") for flag in info["cflags"]) and info["lflags"], info


def test_without_tensorflow_the_build_says_to_install_it(setup_py, tmp_path, monkeypatch):
    monkeypatch.setattr(setup_py.sys, "executable", interpreter(tmp_path, "-S"))  # no site-packages
    with pytest.raises(setup_py.BuildError) as raised:
        setup_py.installed_tensorflow()
    message = str(raised.value)
    assert "cannot import tensorflow" in message and "No module named 'tensorflow'" in message, message
    assert "Install TensorFlow first (e.g. `pip install tensorflow-cpu`)" in message, message


def test_tensorflow_older_than_2_16_stops_the_build_naming_both_versions(setup_py, tmp_path, monkeypatch):
    old = tmp_path / "old"
    (old / "tensorflow").mkdir(parents=True)
    (old / "tensorflow" / "__init__.py").write_text(textwrap.dedent("""
        __version__ = "2.15.1"
        class sysconfig:
            get_compile_flags = staticmethod(lambda: ["-I/old"])
            get_link_flags = staticmethod(lambda: ["-L/old"])
            get_lib = staticmethod(lambda: "/old")
    """))
    # The probe drops PYTHONPATH, so the fake TensorFlow comes in through the interpreter itself.
    monkeypatch.setattr(setup_py.sys, "executable",
                        interpreter(tmp_path, "-S", environment=f"export PYTHONPATH={old}"))
    with pytest.raises(setup_py.BuildError, match=r"tf_rdma needs TensorFlow >= 2\.16, found 2\.15\.1\. "
                                                  r"Upgrade TensorFlow"):
        setup_py.installed_tensorflow()
