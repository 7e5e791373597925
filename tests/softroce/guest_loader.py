"""The Soft-RoCE guest harness (tools/softroce/guest.py), loaded once for the tests in this folder."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUEST_PY = REPO / "tools" / "softroce" / "guest.py"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable


def _load_guest():
    name = "tf_rdma_softroce_guest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GUEST_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


guest = _load_guest()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
