"""The `.pyi` of the native module matches what the extension really exports (mypy stubtest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_native_stub_matches_runtime() -> None:
    tests = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "flexkv_py._native",
            "--allowlist",
            str(tests / "stubtest_allowlist.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tests.parent,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
