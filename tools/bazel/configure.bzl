"""@tf_rdma_config: the TensorFlow, pybind11 and Python of an interpreter's environment as local
libraries, as TensorFlow custom-op repositories' tf_configure does; tools/bazel/configure.py
writes it. The interpreter is $PYTHON_BIN_PATH, else python3 on PATH. Rerun after changing the
TensorFlow installed there: `bazel sync --configure`."""

def _tf_rdma_configure_impl(repository_ctx):
    python = repository_ctx.os.environ.get("PYTHON_BIN_PATH") or repository_ctx.which("python3")
    if not python:
        fail("tf_rdma builds against the TensorFlow of a Python environment: set PYTHON_BIN_PATH " +
             "(e.g. --repo_env=PYTHON_BIN_PATH=$PWD/.venv/bin/python) or put python3 on PATH")
    script = repository_ctx.path(Label("//tools/bazel:configure.py"))

    # setup.py's decisions are read from it: a change to it or to the version reconfigures.
    repository_ctx.path(Label("//:setup.py"))
    repository_ctx.path(Label("//:tf_rdma/__init__.py"))
    result = repository_ctx.execute([python, script, repository_ctx.path(".")], quiet = True)
    if result.return_code != 0:
        fail("tools/bazel/configure.py with %s failed:\n%s%s" % (python, result.stdout, result.stderr))

tf_rdma_configure = repository_rule(
    implementation = _tf_rdma_configure_impl,
    environ = ["PYTHON_BIN_PATH", "CXX"],
    configure = True,
    local = True,
)
