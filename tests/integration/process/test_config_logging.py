"""The configured log level reaches stderr in a fresh interpreter whose host set up no handler
(split from tests/unit/config/test_config.py: it starts a child process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LOGGING_CHILD = """
import logging, sys
from flexkv_py.config import load_config
load_config(env={"FLEXKV_LOG_LEVEL": sys.argv[1]})
log = logging.getLogger("flexkv_py.tiers.example")
log.debug("debug-line")
log.warning("warning-line")
"""


@pytest.mark.parametrize(("level", "shown"), [("DEBUG", 2), ("ERROR", 0)])
def test_log_level_is_visible_without_a_host_handler(level: str, shown: int) -> None:
    # A host like vLLM configures only its own logger: the records must still reach stderr at the
    # configured level (DEBUG shows debug lines; ERROR hides the warning lastResort would print).
    out = subprocess.run(
        [sys.executable, "-c", _LOGGING_CHILD, level],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],  # the repository
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.endswith("-line")]
    assert len(lines) == shown, out.stderr
    if shown:
        assert lines[0] == "DEBUG flexkv_py.tiers.example: debug-line"
