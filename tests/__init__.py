"""tf_rdma's tests. A package so that test files, and the programs they start (`python -m tests.…`,
the repository's root on their path: tests/conftest.py), import the shared helpers by one name,
`tests.…`, wherever they run (the Soft-RoCE guest sees the repository at the same path)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
