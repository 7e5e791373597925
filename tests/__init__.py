"""tf_rdma's tests. A package so that test files, and the programs they start (`python -m tests.…`,
the repository's root on their path: tests/conftest.py), import the shared helpers by one name,
`tests.…`, wherever they run (the Soft-RoCE guest sees the repository at the same path)."""
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# scikit-learn and matplotlib live here, out of .venv's site-packages, or every TensorFlow process
# the tests start would import them (requirements-optional.txt).
OPTIONAL_PACKAGES = REPO / ".venv" / "optional"


def with_optional_packages(env):
    """`env` with OPTIONAL_PACKAGES on its PYTHONPATH: for a process that needs scikit-learn or
    matplotlib (an example, `bench --plot`), and the processes it starts."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(OPTIONAL_PACKAGES)]))}
