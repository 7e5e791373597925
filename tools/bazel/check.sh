#!/usr/bin/env bash
# `make bazel`: builds every target of BUILD with Debian's Bazel, offline, against the TensorFlow,
# pybind11 and Python of .venv; runs the C++ unit tests it built; then runs the transport contract's
# cases the build decides and a TensorFlow session against the extensions it built, in a copy of the package and the
# tests under build/bazel/tree (the checkout's own pip-built extensions stay as they are).
# Everything Bazel writes is under build/bazel: its output base, disk cache and bazel-* links.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=$ROOT/build/bazel
PYTHON=$ROOT/.venv/bin/python
if ! command -v bazel >/dev/null; then
  echo "make bazel needs Bazel: apt-get install bazel-bootstrap bazel-rules-java (tools/install_test_prereqs.sh)" >&2
  exit 1
fi
bazel() { command bazel --output_base="$OUT/output_base" "$@"; }
# The server holds a JVM's memory: gone when this stage is, whatever its outcome.
trap 'bazel shutdown' EXIT
FLAGS=(--config=debian_offline "--repo_env=PYTHON_BIN_PATH=$PYTHON" --jobs=2 "--disk_cache=$OUT/disk_cache"
       --symlink_prefix=build/bazel/bazel- --color=no --curses=no
       # No sandbox: each compile would otherwise mirror TensorFlow's 11,000 headers as symlinks.
       --spawn_strategy=local)
# LLVM's lld where installed (tools/install_test_prereqs.sh): each program linking libtensorflow_cc
# then links in a second instead of GNU ld's 8-12 s.
if command -v ld.lld >/dev/null; then FLAGS+=(--linkopt=-fuse-ld=lld); fi
start=$SECONDS
bazel build "${FLAGS[@]}" //...
echo "tf_rdma: bazel build took $((SECONDS - start)) s"

BIN=$OUT/bazel-bin
"$BIN/transport_unit_tests" --gtest_brief=1
"$BIN/tf_unit_tests" --gtest_brief=1

TREE=$OUT/tree
rm -rf "$TREE"
mkdir -p "$TREE"
tar -c --exclude=__pycache__ --exclude='*.so' tests tf_rdma pyproject.toml | tar -x -C "$TREE"
ln -s "$ROOT/.venv" "$TREE/.venv"
cp "$BIN"/tf_rdma/*.so "$TREE/tf_rdma/"
cd "$TREE"
# The tests put their tree first on the path; this says which extensions they get.
"$PYTHON" -c "
import sys, tf_rdma._transport as t, tf_rdma._tensorflow as tf
for module in (t, tf):
    assert module.__file__.startswith('$TREE/'), module.__file__ + ' is not the Bazel build'
print('tf_rdma: testing', t.__file__, 'and', tf.__file__)
"
# What the Bazel build decides, not the contract (which runs whole against the pip, ASan and TSan
# builds): the handshake, bytes landing exactly within a process and between two, grants in either
# order, a killed peer, and a forked child (one transport core per process, in the shared library).
# Named whole, not matched (-k): a renamed test fails this stage instead of leaving it.
CONTRACT=tests/transport/test_transport.py
"$PYTHON" -m pytest -q -p no:cacheprovider "$CONTRACT::test_handshake_exchanges_names" \
  "$CONTRACT::test_write_lands_exactly_the_bytes_written" "$CONTRACT::test_bytes_cross_between_processes_exactly_both_ways" \
  "$CONTRACT::test_write_waits_for_its_grant_in_either_order" "$CONTRACT::test_killed_peer_fails_pending_grants_promptly" \
  "$CONTRACT::test_a_forked_child_that_lets_go_of_what_it_inherited_leaves_the_parent_working" \
  "$CONTRACT::test_a_forked_child_working_while_transfers_run_disturbs_nothing" \
  tests/tf/test_tf1.py::test_tasks_sharing_a_secret_exchange_tensors
echo "tf_rdma: make bazel took $((SECONDS - start)) s"
