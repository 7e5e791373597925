"""setup.py's check of the target environment's TensorFlow: it finds it even under pip's build
isolation, and without TensorFlow, or with one older than 2.16, it stops saying what to install.
The interpreters here are small wrappers around this one, so no other Python is needed. And a
build on a host without rdma-core's headers: it warns loudly, and its verbs says how to rebuild."""
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from tools.setup_py import load_setup_py

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_py(monkeypatch):
    module = load_setup_py()
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


def test_a_build_without_rdma_core_headers_says_so_loudly_and_verbs_then_says_how_to_rebuild(setup_py, tmp_path):
    # The transport library and extension only (the TensorFlow one is built the same way and costs minutes),
    # into tmp_path, from a mount namespace where rdma-core's header folders are empty. Its objects
    # are cached in build/obj under their own flags, as any build's, so a rerun links only.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the headers needs root and unshare (CI runs as root)")
    hide = "".join(f"mount -t tmpfs none {folder} && " for folder in ("/usr/include/infiniband", "/usr/include/rdma")
                   if Path(folder).is_dir())
    build = textwrap.dedent(f"""
        import importlib.util
        from setuptools import Distribution
        spec = importlib.util.spec_from_file_location("tf_rdma_setup_py", {str(ROOT / "setup.py")!r})
        setup_py = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(setup_py)
        dist = Distribution({{"name": "tf_rdma", "cmdclass": {{"build_ext": setup_py.IncrementalBuildExt}},
                              "ext_modules": [e for e in setup_py.extensions() if e.name != "tf_rdma._tensorflow"]}})
        command = dist.get_command_obj("build_ext")
        command.build_lib, command.build_temp = {str(tmp_path / "lib")!r}, {str(tmp_path / "temp")!r}
        command.ensure_finalized()
        command.run()
    """)
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", f'{hide}exec "$0" -c "$1"',
                             sys.executable, build], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("WARNING: building WITHOUT the verbs (RDMA) backend: rdma-core's development headers",
                 "apt-get install libibverbs-dev librdmacm-dev", "dnf install rdma-core-devel"):
        assert line in result.stderr, result.stderr

    package = tmp_path / "lib" / "tf_rdma"
    for module in (ROOT / "tf_rdma").glob("*.py"):
        shutil.copy(module, package)
    probe = textwrap.dedent(f"""
        import tf_rdma
        from tf_rdma import _transport
        from tf_rdma.transport import choose_backend
        assert tf_rdma.__file__.startswith({str(package)!r}), tf_rdma.__file__
        assert not hasattr(_transport._testing, "decode_verbs_message"), "built with verbs after all"
        assert _transport.backend_available("tcp") == (True, "")
        choose_backend("198.51.100.7")  # TEST-NET-2: never this host; nothing is sent to it
    """)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_")}
    environment.update(PYTHONPATH=str(tmp_path / "lib"), TF_RDMA_BACKEND="verbs")
    asked = subprocess.run([sys.executable, "-c", probe], env=environment, cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)  # not this checkout's tf_rdma, from the working directory
    assert asked.returncode != 0, asked.stdout + asked.stderr
    last_line = asked.stderr.strip().splitlines()[-1]
    assert "TF_RDMA_BACKEND=verbs but that backend is not available: this tf_rdma build has no verbs backend: " \
           "rdma-core's development headers (infiniband/verbs.h, rdma/rdma_cma.h) were missing when it was " \
           "built. Install them (`apt-get install libibverbs-dev librdmacm-dev` on Debian/Ubuntu, `dnf install " \
           "rdma-core-devel` on RHEL/Fedora), then rebuild tf_rdma (`pip install --force-reinstall --no-deps " \
           "/path/to/tf_rdma`)" in last_line, last_line


def test_a_symbol_no_library_exports_fails_the_build_naming_it_and_the_tensorflow(setup_py, tmp_path):
    # As when a TensorFlow built by another compiler exports a template instance the plugin needs
    # under another name: the link succeeds (a shared object may leave symbols undefined), the
    # import would fail with 'undefined symbol'; the build must fail first, naming it.
    from setuptools import Distribution, Extension
    source = tmp_path / "needs_missing.cc"
    source.write_text("namespace tf_rdma_test { int NowhereDefined(unsigned short); }\n"
                      "int Uses() { return tf_rdma_test::NowhereDefined(7); }\n")
    dist = Distribution({"name": "tf_rdma", "cmdclass": {"build_ext": setup_py.IncrementalBuildExt},
                         "ext_modules": [Extension("tf_rdma._needs_missing", [str(source)])]})
    command = dist.get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(tmp_path / "lib"), str(tmp_path / "temp")
    command.ensure_finalized()
    with pytest.raises(setup_py.BuildError) as raised:
        command.run()
    message = str(raised.value)
    tensorflow_version = setup_py.installed_tensorflow()["version"]
    assert f"needs 1 symbol(s) that TensorFlow {tensorflow_version}'s libraries do not export" in message, message
    assert "_ZN12tf_rdma_test14NowhereDefinedEt" in message, message
    assert "= tf_rdma_test::NowhereDefined(unsigned short)" in message, message


def built(setup_py):
    """This checkout's built transport library and extensions."""
    package = ROOT / "tf_rdma"
    library = package / f"lib{setup_py.TRANSPORT_LIBRARY}.so"
    extensions = sorted(package.glob("_*.so"))
    assert library.exists() and {e.name.split(".")[0] for e in extensions} == {"_transport", "_tensorflow"}
    return library, extensions


def test_the_built_extensions_need_no_symbol_their_libraries_lack(setup_py):
    # What the build checks, checked on this checkout's own build (the suite's TensorFlow).
    library, extensions = built(setup_py)
    for built_file in (library, *extensions):
        assert setup_py.undefined_symbols_nothing_exports(built_file) == [], built_file


def tf_rdma_data(path):
    """Demangled names of the variables (static or not) in tf_rdma's namespace that `path` defines."""
    listed = subprocess.run(["nm", "-C", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    names = set()
    for line in listed.stdout.splitlines():
        _, kind, name = line.split(" ", 2)
        # bss, data, small data, unique and weak objects; not a library's constant tables that
        # instantiate with tf_rdma's types (std::variant's dispatch tables, pybind11's signatures).
        if kind in "bBdDgGsSuV" and name.startswith(("tf_rdma::", "guard variable for tf_rdma::")):
            names.add(name)
    return names


def test_the_process_wide_state_of_the_transport_is_in_its_library_only(setup_py):
    # Both extensions link the one transport library: a variable of the core that an extension
    # defined too (a header's inline function with a static, built into it) would be a second copy.
    library, extensions = built(setup_py)
    core = tf_rdma_data(library)
    assert "tf_rdma::(anonymous namespace)::tcp_connections_started" in core, sorted(core)
    for extension in extensions:
        needed = subprocess.run(["readelf", "-d", str(extension)], capture_output=True, text=True, check=True).stdout
        assert f"[{library.name}]" in needed and "$ORIGIN" in needed, needed
        assert not core & tf_rdma_data(extension), (extension.name, sorted(core & tf_rdma_data(extension)))
