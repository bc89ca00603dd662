"""Cache files are private (KV blocks reveal prompts): real directories, real modes.

Stores are opened in subprocesses where the umask matters, so this process's umask is never
changed; `flexkv-py inspect` runs as a subprocess like in test_cli.py.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flexkv_py import BlockStore
from flexkv_py.config import load_config
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.private_files import make_private_dir
from flexkv_py.tiers.ssd.tier import SsdTier
from integration.cli.test_cli import cli

ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20

# Opens an SsdTier (or a bare BlockStore) under the given umask, stores a block, closes.
OPEN_UNDER_UMASK = textwrap.dedent(
    """
    import os, sys
    os.umask(int(sys.argv[2], 8))
    from flexkv_py import BlockStore
    from flexkv_py.config import load_config
    from flexkv_py.index.namespace import Namespace
    from flexkv_py.tiers.ssd.tier import SsdTier
    if sys.argv[3] == "tier":
        cfg = load_config(
            {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.05, "ssd_cache_dir": sys.argv[1]}, env={}
        )
        ns = Namespace(model="m", revision=None, kv_dtype="bf16", kv_layout="L", block_size=16)
        tier = SsdTier(cfg, ns)
        assert tier.store.put(b"k", b"x" * 4096).ok
        tier.close()
    else:
        with BlockStore(sys.argv[1], 8 << 20) as store:
            assert store.put(b"k", b"x" * 4096).ok
    """
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def open_under_umask(directory: Path, umask: int, kind: str) -> None:
    subprocess.run(
        [sys.executable, "-c", OPEN_UNDER_UMASK, str(directory), f"{umask:o}", kind],
        cwd=ROOT,
        check=True,
        timeout=120,
    )


def store_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file())
    names = {p.name for p in files}
    assert {"flexkv-blocks.dat", "flexkv-journal.log", "flexkv.lock"} <= names, names
    return files


def tier(root: Path) -> SsdTier:
    values = {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.05, "ssd_cache_dir": str(root)}
    cfg = load_config(values, env={})
    ns = Namespace(model="m", revision=None, kv_dtype="bf16", kv_layout="L", block_size=16)
    return SsdTier(cfg, ns)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_tier_creates_a_private_shard(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o755)  # the user's directory: left as it is
    open_under_umask(root, umask, "tier")
    assert mode(root) == 0o755
    shard = root / "tp0-pp0"
    assert mode(shard) == 0o700
    for f in store_files(shard):
        assert mode(f) == 0o600, f


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_bare_store_files_are_private(tmp_path: Path, umask: int) -> None:
    tmp_path.chmod(0o755)
    open_under_umask(tmp_path, umask, "store")
    assert mode(tmp_path) == 0o755  # given by the caller: never chmod-ed
    for f in store_files(tmp_path):
        assert mode(f) == 0o600, f


def test_old_world_readable_store_is_tightened_on_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    assert t.store.put(b"k", b"y" * 4096).ok
    t.close()
    shard = tmp_path / "tp0-pp0"
    # What a store created before private files looks like.
    shard.chmod(0o755)
    for f in store_files(shard):
        f.chmod(0o644)
    with caplog.at_level(logging.INFO, logger="flexkv_py.tiers.private_files"):
        t = tier(tmp_path)
    try:
        assert t.store.read(b"k") == b"y" * 4096
    finally:
        t.close()
    assert mode(shard) == 0o700
    for f in store_files(shard):
        assert mode(f) == 0o600, f
    logged = [r.getMessage() for r in caplog.records]
    assert any("made private" in m and str(shard) in m for m in logged), logged


def test_read_only_inspect_changes_no_mode(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 8 * MiB) as store:
        store.put(b"k", b"x" * 4096)
    for f in store_files(tmp_path):
        f.chmod(0o644)
    cli("inspect", tmp_path, "--json")
    assert all(mode(f) == 0o644 for f in store_files(tmp_path))


def test_inspect_warns_about_a_world_readable_directory(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    with _shard(root) as store:
        store.put(b"k", b"x" * 4096)
    root.chmod(0o755)
    data = root / "tp0-pp0" / "flexkv-blocks.dat"
    data.chmod(0o644)

    proc = cli("inspect", root, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["private"] is False
    warned = {w["path"]: w for w in report["privacy_warnings"]}
    assert set(warned) == {str(root), str(data)}
    assert warned[str(data)]["mode"] == "0644" and warned[str(data)]["fix"] == f"chmod 600 {data}"
    assert warned[str(root)]["mode"] == "0755" and warned[str(root)]["fix"] == f"chmod 700 {root}"
    for path, fix in ((root, "chmod 700"), (data, "chmod 600")):
        assert f"{path} (mode 0" in proc.stderr and f"{fix} {path}" in proc.stderr

    text = cli("inspect", root)
    assert text.returncode == 0 and "warning:" in text.stderr and str(data) in text.stderr


def test_inspect_is_quiet_about_a_private_directory(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    with _shard(root) as store:
        store.put(b"k", b"x" * 4096)
    proc = cli("inspect", root, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["private"] is True and report["privacy_warnings"] == []
    assert "warning" not in proc.stderr


def _shard(root: Path) -> BlockStore:
    shard = root / "tp0-pp0"
    make_private_dir(str(shard))
    return BlockStore(str(shard), 8 * MiB)


def test_make_private_dir_creates_every_missing_level_0700(tmp_path: Path) -> None:
    leaf = tmp_path / "a" / "b" / "c"
    assert make_private_dir(str(leaf))
    for d in (tmp_path / "a", tmp_path / "a" / "b", leaf):
        assert mode(d) == 0o700, d
    assert not make_private_dir(str(leaf))  # exists: nothing to do
    assert os.path.isdir(leaf)
