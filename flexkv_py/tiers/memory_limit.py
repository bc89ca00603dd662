"""The container's memory limit, for refusing a host pool that cannot fit in it at start
instead of being OOM-killed mid-serve when the pool is touched.

Read from the process's own cgroup (and its ancestors: the smallest limit wins): cgroup v2
``memory.max`` ("max" = no limit), or cgroup v1 ``memory.limit_in_bytes`` when v2 has none.
Paths are parameters so tests can point them at a fake layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flexkv_py.errors import ConfigError

GIB = 1 << 30
# cgroup v1 writes "no limit" as the largest page-aligned i64 (9223372036854771712).
V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    limit_bytes: int
    source: str  # the cgroup file it was read from


def _own_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory-controller path) from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _smallest(root: str, path: str, name: str) -> MemoryLimit | None:
    """The smallest limit in `name` files of the cgroup `path` and its ancestors under
    `root`; None when no such file exists or none sets a limit."""
    found: MemoryLimit | None = None
    rel = path.strip("/")
    while True:
        file = os.path.join(root, rel, name) if rel else os.path.join(root, name)
        try:
            with open(file) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) < V1_UNLIMITED:
            if found is None or int(text) < found.limit_bytes:
                found = MemoryLimit(int(text), file)
        if not rel:
            return found
        rel = os.path.dirname(rel)


def _has_v2(root: str, path: str) -> bool:
    rel = path.strip("/")
    while True:
        if os.path.exists(os.path.join(root, rel, "memory.max")):
            return True
        if not rel:
            return False
        rel = os.path.dirname(rel)


def cgroup_memory_limit(
    proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> MemoryLimit | None:
    """This process's memory limit, or None when there is none (or no cgroup is readable)."""
    v2, v1 = _own_paths(proc_cgroup)
    if v2 is not None and _has_v2(cgroup_root, v2):
        return _smallest(cgroup_root, v2, "memory.max")
    if v1 is not None:
        return _smallest(os.path.join(cgroup_root, "memory"), v1, "memory.limit_in_bytes")
    return None


def check_host_pool_fits(
    cpu_cache_gb: float,
    rank_bytes: int,
    world_size: int,
    *,
    proc_cgroup: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> None:
    """ConfigError when this rank's host pool (`rank_bytes` of cpu_cache_gb) exceeds the limit."""
    limit = cgroup_memory_limit(proc_cgroup, cgroup_root)
    if limit is None or rank_bytes <= limit.limit_bytes:
        return
    raise ConfigError(
        f"cpu_cache_gb: {cpu_cache_gb:g} GiB over {world_size} rank(s) needs a host pool of "
        f"{rank_bytes / GIB:.2f} GiB per rank, more than this container's memory limit of "
        f"{limit.limit_bytes / GIB:.2f} GiB ({limit.limit_bytes} bytes, {limit.source}); lower "
        "cpu_cache_gb or raise the limit"
    )
