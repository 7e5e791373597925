#!/usr/bin/env bash
# `make test` after its installs: the Soft-RoCE family (tests/softroce: qemu guests, about 18 minutes
# that keep roughly one of two cores busy) in one lane, and beside it everything else in a second:
# the C++ tests, sanitizers, fuzzing and Bazel stages, then the host's pytest files, the least
# CPU-hungry first (the transport suites, mostly waiting on timeouts and peers) so that the
# TensorFlow clusters, which want every core, mostly run after the guests are done.
# Either lane failing fails the run; the guests' output is printed whole when they finish.
set -uo pipefail
cd "$(dirname "$0")/.."

LOGS=build/test-logs
mkdir -p "$LOGS"
PYTEST=(.venv/bin/python -m pytest)

# What runs beside the guests first, in this order; every other test file follows, sorted.
BESIDE_GUESTS=(tests/transport tests/test_readme.py tests/test_info.py tests/deploy
               tests/tf/test_coordinator_failures.py tests/tf/test_serving_many_workers.py
               tests/tf/test_server_config.py tests/test_doctor.py tests/test_setup.py)

host_files() {
  .venv/bin/python - "${BESIDE_GUESTS[@]}" <<'EOF'
import sys
from pathlib import Path

def files(path):
    path = Path(path)
    if not path.exists():
        sys.exit(f"tools/run_tests.sh: {path} (in BESIDE_GUESTS) does not exist")
    return sorted(str(p) for p in path.rglob("test_*.py")) if path.is_dir() else [str(path)]

first = [f for entry in sys.argv[1:] for f in files(entry)]
rest = [f for f in files("tests") if not f.startswith("tests/softroce/") and f not in first]
print("\n".join(first + rest))
EOF
}

started=$(date +%s)
( "${PYTEST[@]}" -p no:cacheprovider tests/softroce --durations=15 >"$LOGS/softroce.log" 2>&1
  status=$?
  echo $(( $(date +%s) - started )) >"$LOGS/softroce.seconds"
  exit $status ) &
guests=$!
echo "tf_rdma: tests/softroce runs beside the rest (its output: $LOGS/softroce.log, printed when it ends)"

host=0
make --no-print-directory -o env -o test-prereqs cc-tests sanitizers fuzz bazel || host=$?
if [ "$host" = 0 ]; then
  files=$(host_files) || host=$?
fi
if [ "$host" = 0 ]; then
  # shellcheck disable=SC2086 # one path per line, none with spaces
  "${PYTEST[@]}" $files --durations=30 || host=$?
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
