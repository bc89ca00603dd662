"""The io_uring → pread/pwrite fallback, under a real seccomp filter like Docker's default."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers.writers import TESTS_DIR, argv


def test_auto_falls_back_to_psync_when_io_uring_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        argv("seccomp_child", str(tmp_path)),
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["io_uring_available"] is False
    assert report["auto_engine"] == "psync"
    assert report["put"] == "ok" and report["roundtrip"] is True
    assert str(report["forced"]).startswith("IoEngineError: io_engine=io_uring")
    # The fallback is announced through Python logging (Rust log records are forwarded).
    assert "falling back to the pread/pwrite engine" in out.stderr
