"""Who owns the top-level `flexkv` package: flexkv-py, or the original FlexKV as well.

Both distributions ship `flexkv/` (flexkv-py only as the compatibility path vLLM's built-in shim
imports). pip cannot stop two distributions from installing the same package: the last install
overwrites the other's files, and either one may then half-work. So the connector refuses to
start when another distribution also owns `flexkv`, naming both. The check reads package metadata
and the file on disk; it never imports the foreign package (its import has side effects).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
from functools import cache

from flexkv_py.errors import ConfigError

logger = logging.getLogger(__name__)

OUR_DISTRIBUTION = "flexkv-py"
MARKER = "__flexkv_py__ = True"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def foreign_owners() -> list[str]:
    """Distributions other than flexkv-py that install a top-level `flexkv` package."""
    owners = importlib.metadata.packages_distributions().get("flexkv", [])
    return sorted({o for o in owners if _canonical(o) != OUR_DISTRIBUTION})


def _file_is_ours(origin: str) -> bool:
    try:
        with open(origin, encoding="utf-8") as f:
            return MARKER in f.read()
    except OSError:
        return False


def conflict() -> str | None:
    """The error to refuse with, or None when `flexkv` is flexkv-py's alone."""
    foreign = foreign_owners()
    if foreign:
        other = foreign[0]
        return (
            f"two packages install the Python package 'flexkv': {OUR_DISTRIBUTION} and "
            f"{' and '.join(foreign)} (the original FlexKV, github.com/taco-project/FlexKV). pip "
            "cannot keep both: the last install overwrote the other's files. Keep one: "
            f"`pip uninstall {other}` and then `pip install --force-reinstall {OUR_DISTRIBUTION}` "
            f"to use {OUR_DISTRIBUTION}, or `pip uninstall {OUR_DISTRIBUTION}` to use FlexKV."
        )
    spec = importlib.util.find_spec("flexkv")
    if spec is None or spec.origin is None or _file_is_ours(spec.origin):
        return None  # flexkv-py's own files, or no `flexkv` at all (nothing can clash)
    return (
        f"the Python package 'flexkv' at {spec.origin} is not {OUR_DISTRIBUTION}'s (the original "
        "FlexKV, installed without package metadata?). Remove it, then `pip install "
        f"--force-reinstall {OUR_DISTRIBUTION}`."
    )


@cache
def check_flexkv_owner() -> None:
    """Raise ConfigError when the original FlexKV is installed beside flexkv-py (checked once
    per process: installs do not change under a running engine)."""
    problem = conflict()
    if problem is not None:
        raise ConfigError(problem)
