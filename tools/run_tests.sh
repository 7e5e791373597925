#!/usr/bin/env bash
# `make test` after its installs, in two lanes at once: the Soft-RoCE family (tests/softroce: qemu
# guests, about 20 minutes that keep roughly one of two cores busy) in one; in the other the
# sanitizer, fuzzing and Bazel stages, then every other pytest file in two pytest-xdist workers. The
# C++ unit tests run in the Bazel stage, built from the same sources as `make cc-tests` builds them
# for `make check`: built a second time here, they would only take the cores from the rest. Most
# of the pytest files wait more than they compute (peer timeouts, frozen and killed tasks, impaired
# links: one core's worth on average when run one at a time), so two at once keep both cores busy;
# the slowest files go first, so that the two workers end together.
# From the start, at the lowest CPU priority, the TensorFlow matrix's venvs are made and built
# (tests/tensorflow_versions/conftest.py); its tests run last.
# Either lane failing fails the run; the guests' output is printed whole when they finish.
set -uo pipefail
cd "$(dirname "$0")/.."

LOGS=build/test-logs
mkdir -p "$LOGS"
PYTEST=(.venv/bin/python -m pytest)
HOST_WORKERS=2

# The files with the longest runs (one at a time: 50-220 s each), handed out first; every other
# test file follows, sorted, and tests/tensorflow_versions last.
SLOWEST_FIRST=(tests/tf/test_tf1.py tests/tf/test_data_service.py tests/faults/test_wire_faults.py
               tests/faults/test_chaos.py tests/examples/test_examples.py tests/transport/test_adversarial.py
               tests/tf/test_fault_tolerance.py tests/tf/coverage/test_grpc_share.py
               tests/tf/test_serving_many_workers.py tests/tf/test_soak.py tests/tf/test_bench_tf.py
               tests/faults/test_ps_strategy_faults.py tests/tf/test_collectives.py tests/transport/test_transport.py)
LAST=(tests/tensorflow_versions)

host_files() {
  .venv/bin/python - "${#SLOWEST_FIRST[@]}" "${SLOWEST_FIRST[@]}" "${LAST[@]}" <<'PY'
import sys
from pathlib import Path

def files(path):
    path = Path(path)
    if not path.exists():
        sys.exit(f"tools/run_tests.sh: {path} (in SLOWEST_FIRST or LAST) does not exist")
    return sorted(str(p) for p in path.rglob("test_*.py")) if path.is_dir() else [str(path)]

count, named = int(sys.argv[1]), sys.argv[2:]
first = [f for entry in named[:count] for f in files(entry)]
last = [f for entry in named[count:] for f in files(entry)]
rest = [f for f in files("tests") if not f.startswith("tests/softroce/") and f not in first + last]
print("\n".join(first + rest + last))
PY
}

started=$(date +%s)
# SCHED_IDLE and idle I/O: it only takes what nothing else wants. Its own process group, ended
# with the run.
export TFRDMA_TEST_VERSIONS_BUILD_ID
TFRDMA_TEST_VERSIONS_BUILD_ID=$(.venv/bin/python -c 'import uuid; print(uuid.uuid4().hex)')
setsid ionice -c 3 chrt --idle 0 .venv/bin/python tools/tensorflow_versions.py prepare \
  --build-id "$TFRDMA_TEST_VERSIONS_BUILD_ID" >"$LOGS/tensorflow-versions-prepare.log" 2>&1 </dev/null &
preparation=$!
trap 'kill -- -"$preparation" 2>/dev/null' EXIT

( "${PYTEST[@]}" -p no:cacheprovider tests/softroce --durations=15 >"$LOGS/softroce.log" 2>&1
  status=$?
  echo $(( $(date +%s) - started )) >"$LOGS/softroce.seconds"
  exit $status ) &
guests=$!
echo "tf_rdma: tests/softroce runs beside the rest (its output: $LOGS/softroce.log, printed when it ends)"

host=0
make --no-print-directory -o env -o test-prereqs sanitizers fuzz bazel || host=$?
if [ "$host" = 0 ]; then
  files=$(host_files) || host=$?
fi
if [ "$host" = 0 ]; then
  echo "tf_rdma: the host's pytest files start $(( $(date +%s) - started )) s in, in $HOST_WORKERS workers"
  # shellcheck disable=SC2086 # one path per line, none with spaces
  "${PYTEST[@]}" -n "$HOST_WORKERS" --dist loadfile $files --durations=30 || host=$?
fi
host_seconds=$(( $(date +%s) - started ))

wait "$guests"
guest=$?
echo "==== tests/softroce: $(cat "$LOGS/softroce.seconds" 2>/dev/null) s; the host lane: $host_seconds s ===="
cat "$LOGS/softroce.log"
if [ "$host" != 0 ] || [ "$guest" != 0 ]; then
  echo "tf_rdma: make test failed (host lane status $host, tests/softroce status $guest)"
  exit 1
fi
