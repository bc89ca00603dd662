"""Cache files are private: KV blocks reveal the prompts they were computed from.

The native store creates its files 0600 (and tightens older 0644 ones on open). This module is
the Python side: directories flexkv-py creates are made 0700 (the umask can only make that
stricter), and `exposed` finds paths that group or others can reach, for warnings.
A directory the user made (the configured ``ssd_cache_dir`` root) is never chmod-ed: only
warned about.
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
GROUP_OTHER = 0o077


@dataclass(frozen=True)
class Exposed:
    """A path that group or others can read, write or enter."""

    path: str
    mode: int
    is_dir: bool

    @property
    def fix(self) -> str:
        return f"chmod {'700' if self.is_dir else '600'} {shlex.quote(self.path)}"

    @property
    def message(self) -> str:
        can = [w for w, bits in (("read", 0o044), ("write", 0o022)) if self.mode & bits]
        how = " and ".join(can) if can else "enter"
        return (
            f"{self.path} (mode {self.mode:04o}) lets group/others {how} it; cached KV blocks "
            f"reveal the prompts they were computed from: {self.fix}"
        )

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "mode": f"{self.mode:04o}", "fix": self.fix}


def exposed(path: str) -> Exposed | None:
    """`path` if group/others have any access to it, else None (also when it is gone)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not mode & GROUP_OTHER:
        return None
    return Exposed(path, mode, stat.S_ISDIR(st.st_mode))


def make_private_dir(path: str) -> bool:
    """Create `path` and its missing parents with mode 0700 (os.makedirs would give parents
    the umask's default). True when `path` itself was created."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return False
    parent = os.path.dirname(path)
    if parent != path:
        make_private_dir(parent)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return False  # created by a concurrent opener (another rank)
    return True


def tighten_dir(path: str) -> None:
    """Take group/other access away from a directory flexkv-py created (a shard directory
    from before private files). Only removes bits: a stricter mode stays."""
    found = exposed(path)
    if found is None or not found.is_dir:
        return
    private = found.mode & ~GROUP_OTHER
    try:
        os.chmod(path, private)
    except OSError as e:
        logger.warning("%s; cannot make it private: %s", found.message, e.strerror)
        return
    logger.info("cache directory made private: %s %04o -> %04o", path, found.mode, private)


def warn_if_exposed(path: str) -> None:
    """Warn (never chmod) about a directory the user made."""
    found = exposed(path)
    if found is not None:
        logger.warning("ssd_cache_dir: %s", found.message)
