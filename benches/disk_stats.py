"""ssd_bench's view of the disk under a directory: sectors it moved (/sys/dev/block/*/stat, every
user of the disk counts) and a settle before each timed phase, so no path pays for another's
deferred writes."""

from __future__ import annotations

import os
import time
from pathlib import Path


def disk_stat_file(path: Path) -> Path | None:
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return stat if stat.exists() else None


def disk_sectors(stat: Path | None) -> tuple[int, int]:
    """(sectors read, sectors written) so far on the disk (all its users)."""
    if stat is None:
        return (0, 0)
    f = stat.read_text().split()
    return (int(f[2]), int(f[6]))


def settle(path: Path, quiet: float = 0.25, timeout: float = 5.0) -> None:
    """Outside the timed region: flush what earlier phases left dirty (os.sync, which also commits
    the filesystem journal and its online discards), then wait until the disk has been idle for
    `quiet` seconds, so no path pays for another's deferred work."""
    os.sync()
    stat = disk_stat_file(path)
    if stat is None:
        return
    start = last_change = time.perf_counter()
    last = stat.read_text().split()
    while time.perf_counter() - start < timeout:
        time.sleep(0.05)
        cur = stat.read_text().split()
        if cur[9] != last[9] or cur[8] != "0":  # io_ticks moved, or requests in flight
            last_change = time.perf_counter()
        last = cur
        if time.perf_counter() - last_change >= quiet:
            return
