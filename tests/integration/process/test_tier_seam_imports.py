"""The coordinator imports without torch, in a fresh interpreter (split from
tests/unit/coordinator/test_tier_seam.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_coordinator_imports_without_torch() -> None:
    code = "import sys, flexkv_py.coordinator; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "False"
