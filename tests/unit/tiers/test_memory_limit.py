"""The host-pool check against the container's memory limit, on fake cgroup layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexkv_py.errors import ConfigError
from flexkv_py.tiers.memory_limit import cgroup_memory_limit, check_host_pool_fits

GIB = 1 << 30
V1_UNLIMITED = "9223372036854771712"


def layout(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    """A fake /proc/self/cgroup and /sys/fs/cgroup tree; returns their paths."""
    root = tmp_path / "sys-fs-cgroup"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    root.mkdir(parents=True, exist_ok=True)
    proc_file = tmp_path / "proc-self-cgroup"
    proc_file.write_text(proc)
    return str(proc_file), str(root)


def test_v2_limit_over_the_pool_is_a_config_error(tmp_path: Path) -> None:
    proc, root = layout(tmp_path, "0::/kubepods/pod1\n", {"kubepods/pod1/memory.max": str(8 * GIB)})
    limit = cgroup_memory_limit(proc, root)
    assert limit is not None and limit.limit_bytes == 8 * GIB
    check_host_pool_fits(8.0, 8 * GIB, 1, proc_cgroup=proc, cgroup_root=root)  # exactly fits
    with pytest.raises(ConfigError) as e:
        check_host_pool_fits(16.0, 16 * GIB, 1, proc_cgroup=proc, cgroup_root=root)
    msg = str(e.value)
    assert msg.startswith("cpu_cache_gb: 16 GiB")
    assert str(8 * GIB) in msg and "8.00 GiB" in msg
    assert f"{root}/kubepods/pod1/memory.max" in msg


def test_v2_max_means_no_limit(tmp_path: Path) -> None:
    proc, root = layout(tmp_path, "0::/a\n", {"a/memory.max": "max"})
    assert cgroup_memory_limit(proc, root) is None
    check_host_pool_fits(1e6, 1 << 60, 1, proc_cgroup=proc, cgroup_root=root)


def test_a_parent_cgroup_limit_applies(tmp_path: Path) -> None:
    proc, root = layout(
        tmp_path, "0::/a/b\n", {"a/memory.max": str(2 * GIB), "a/b/memory.max": "max"}
    )
    limit = cgroup_memory_limit(proc, root)
    assert limit is not None and limit.limit_bytes == 2 * GIB
    assert limit.source == f"{root}/a/memory.max"


def test_container_cgroup_namespace_root(tmp_path: Path) -> None:
    # Inside a cgroup namespace the process sees itself at "/" and the limit at the mount root.
    proc, root = layout(tmp_path, "0::/\n", {"memory.max": str(4 * GIB)})
    limit = cgroup_memory_limit(proc, root)
    assert limit is not None and limit.limit_bytes == 4 * GIB


def test_v1_when_v2_has_no_memory_controller(tmp_path: Path) -> None:
    proc_text = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    proc, root = layout(
        tmp_path,
        proc_text,
        {
            "memory/memory.limit_in_bytes": V1_UNLIMITED,
            "memory/docker/abc/memory.limit_in_bytes": str(3 * GIB),
        },
    )
    limit = cgroup_memory_limit(proc, root)
    assert limit is not None and limit.limit_bytes == 3 * GIB
    with pytest.raises(ConfigError, match=r"memory\.limit_in_bytes"):
        check_host_pool_fits(8.0, 4 * GIB, 2, proc_cgroup=proc, cgroup_root=root)


def test_v1_unlimited_and_missing_files_mean_no_limit(tmp_path: Path) -> None:
    proc, root = layout(tmp_path, "3:memory:/x\n", {"memory/x/memory.limit_in_bytes": V1_UNLIMITED})
    assert cgroup_memory_limit(proc, root) is None
    assert cgroup_memory_limit(str(tmp_path / "absent"), root) is None
    proc2, root2 = layout(tmp_path / "empty", "0::/nowhere\n", {})
    assert cgroup_memory_limit(proc2, root2) is None


def test_this_machine_reads_without_error() -> None:
    limit = cgroup_memory_limit()
    assert limit is None or limit.limit_bytes > 0
