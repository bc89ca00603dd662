"""Give the freed heap back to the operating system after a burst of short-lived objects.

A restart builds and frees a few objects per stored block (the workers' reports, the
scheduler's read of the shards, the settle). glibc keeps the freed pages in its arenas, so the
process's RSS stays at the peak: ~490 B per cached block at 1 M blocks where the live indexes
hold ~97 B (benches/rss_bench.py). `malloc_trim(0)` returns every free page of every arena.
Elsewhere (musl, macOS) there is no such call and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def return_freed_memory(after: str) -> int:
    """Return freed heap pages to the OS (`after`: what freed them, for the log); the bytes of
    RSS it gave back (0 when the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is None:
        return 0
    before = rss_bytes()
    trim(0)
    given = max(0, before - rss_bytes())
    logger.debug("returned %.1f MiB of freed heap after %s", given / 2**20, after)
    return given
