"""Scripts the tests start as child processes (writers killed mid-write, restart children, ...).

Each runs as `python -m helpers.writers.<name>` from tests/ (`TESTS_DIR`), so that it imports
the other helpers the way the tests do: `subprocess.run(argv(name, ...), cwd=TESTS_DIR)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[2]


def argv(name: str, *args: str) -> list[str]:
    """The command line that runs helpers/writers/<name>.py with `args`."""
    return [sys.executable, "-m", f"{__name__}.{name.removesuffix('.py')}", *args]
