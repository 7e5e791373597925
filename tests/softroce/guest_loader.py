"""The Soft-RoCE guest harness (tools/softroce/guest.py) and what the tests in this folder run in it."""
from __future__ import annotations

import os
import sys

from tests import REPO
from tools.softroce import guest

GUEST_PY = REPO / "tools" / "softroce" / "guest.py"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
