#!/usr/bin/env bash
# Creates (or refreshes) .venv with TensorFlow and the test tools, and builds tf_rdma into it in
# place. Idempotent and incremental: a second run rebuilds only changed C++ files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "tf_rdma: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.requirements.sha256
if ! sha256sum --status -c "$stamp" 2>/dev/null || [ ! -d .venv/optional/sklearn ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
  # Out of site-packages (requirements-optional.txt says why); a .venv made before goes without.
  if .venv/bin/python -m pip show -q scikit-learn matplotlib >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -q -y scikit-learn matplotlib
  fi
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/optional -r requirements-optional.txt
  sha256sum requirements-dev.txt requirements-nodeps.txt requirements-optional.txt > "$stamp"
fi
# --no-build-isolation: build against the TensorFlow in .venv, without pip re-resolving build deps.
.venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
