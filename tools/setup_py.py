"""The repository's setup.py as a module: its build decisions, for tools that build tf_rdma
another way (sanitized, without profiler events) and for the tests that check those decisions."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_setup_py():
    spec = importlib.util.spec_from_file_location("tf_rdma_setup_py", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the build, runs nothing
    return module


def build_extensions(setup_py, extensions, build_lib):
    """Builds `extensions` (from setup_py.extensions()) as setup.py's build_ext does, with the
    caller's CXX, CXXFLAGS and LDFLAGS, into the package tree under `build_lib`."""
    from setuptools import Distribution
    distribution = Distribution({"name": "tf_rdma", "ext_modules": extensions,
                                 "cmdclass": {"build_ext": setup_py.IncrementalBuildExt}})
    command = distribution.get_command_obj("build_ext")
    command.build_lib = str(build_lib)
    command.ensure_finalized()
    command.run()
