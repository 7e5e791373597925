"""The programs of the TensorFlow tests' clusters, and what starts them (cluster.py). Each task is
`python tests/tf/programs/PROGRAM.py FUNCTION JSON_ARGS`, run by path: tests/tensorflow_versions
runs tasks.py and collective.py under venvs whose own tf_rdma the checkout's must not shadow, with
nothing of the checkout on their path (so these two import nothing from tests); the others import
the shared helpers as `tests.…`, the checkout's root on their path (tests/conftest.py)."""
