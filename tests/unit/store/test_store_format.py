"""Format versions: a store written by another on-disk format version is set aside (its files
moved to ``<dir>/set-aside/v<old>-<secs>/``, one WARNING, started empty), never a crash loop;
a directory holding foreign files is still refused and left untouched. The version before this
build's (v3: 8-byte content tags, v4 keeps 6) is migrated: read whole, rewritten as v4."""

from __future__ import annotations

import logging
import shutil
import struct
import time
from pathlib import Path

import pytest
from helpers.store_util import block

from flexkv_py import _native
from flexkv_py._native import BlockStore, CorruptBlockError

MiB = 1 << 20
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
V1 = DATA_DIR / "store-v1"  # written by the v1 code, 3 blocks of 8000 B
V1_KEYS = (b"v1/a", b"v1/b", b"v1/c")
# Written by the v2 code (16-byte content hashes in the journal), 3 blocks of 8000 B.
V2 = DATA_DIR / "store-v2"
V2_KEYS = (b"v2/a", b"v2/b", b"v2/c")
# Written by the v3 code (8-byte content tags): 3 blocks of 8000 B, and v3/d holding v3/a's bytes
# (one content under two keys).
V3 = DATA_DIR / "store-v3"
V3_KEYS = (b"v3/a", b"v3/b", b"v3/c", b"v3/d")
JOURNAL = "flexkv-journal.log"
DATA = "flexkv-blocks.dat"


def _copy_v1(dst: Path, version: int | None = None) -> Path:
    shutil.copytree(V1, dst)
    if version is not None:  # fabricate another version: same bytes, other version field
        with open(dst / JOURNAL, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", version))
    return dst


def _set_aside_warning(caplog: pytest.LogCaptureFixture, directory: Path) -> list[str]:
    # Rust records reach Python logging through a forwarding thread: wait (bounded) for it.
    deadline = time.monotonic() + 30
    while True:
        found = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and "set-aside" in r.getMessage()
        ]
        if found or time.monotonic() > deadline:
            return [m for m in found if str(directory) in m]
        time.sleep(0.01)


def _assert_set_aside(directory: Path, version: int, original: bytes) -> None:
    (aside,) = (directory / "set-aside").iterdir()
    assert aside.name.startswith(f"v{version}-")
    assert (aside / JOURNAL).read_bytes() == original  # moved as it was, not rewritten
    assert (aside / DATA).exists()


OLD_STORES = {1: (V1, V1_KEYS), 2: (V2, V2_KEYS)}


@pytest.mark.parametrize("version", sorted(OLD_STORES), ids=lambda v: f"v{v}")
def test_old_store_opens_or_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, version: int
) -> None:
    fixture, keys = OLD_STORES[version]
    d = tmp_path / f"v{version}"
    shutil.copytree(fixture, d)
    original = (d / JOURNAL).read_bytes()
    with caplog.at_level(logging.WARNING), BlockStore(str(d), 16 * MiB) as store:
        if _native.JOURNAL_FORMAT_VERSION == version:
            assert sorted(store.keys()) == sorted(keys)
            for k in keys:
                assert store.read(k) == block(k, 8000)
            return
        assert len(store) == 0
        assert store.put(b"new", block(b"new", 8000)).ok
    _assert_set_aside(d, version, original)
    (msg,) = _set_aside_warning(caplog, d)
    assert f"v{version}; this build reads v{_native.JOURNAL_FORMAT_VERSION}" in msg
    # The restart after the set-aside opens the new store as it is.
    with BlockStore(str(d), 16 * MiB) as store:
        assert store.keys() == [b"new"]
        assert store.read(b"new") == block(b"new", 8000)


@pytest.mark.parametrize("delta", [-1, +1], ids=["older", "newer"])
def test_other_version_is_set_aside_logged_once_and_started_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, delta: int
) -> None:
    # Older: two back (the one before this build's is migrated, tested below).
    version = _native.JOURNAL_FORMAT_VERSION + (delta if delta > 0 else 2 * delta)
    d = _copy_v1(tmp_path / "store", version=version)
    original = (d / JOURNAL).read_bytes()
    with caplog.at_level(logging.WARNING):
        with BlockStore(str(d), 16 * MiB) as store:
            assert len(store) == 0
            assert store.put(b"new", block(b"new", 8000)).ok
        # A restart opens the new store: no second set-aside, the new block is there.
        with BlockStore(str(d), 16 * MiB) as store:
            assert store.keys() == [b"new"]
            assert store.read(b"new") == block(b"new", 8000)
    _assert_set_aside(d, version, original)
    (msg,) = _set_aside_warning(caplog, d)
    assert f"format v{version}; this build reads v{_native.JOURNAL_FORMAT_VERSION}" in msg


def test_other_version_spanning_two_directories_sets_both_aside(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    with BlockStore([str(d) for d in dirs], 16 * MiB) as store:
        for k in (b"x", b"y", b"z"):
            assert store.put(k, block(k, 8000)).ok
    with open(dirs[0] / JOURNAL, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", _native.JOURNAL_FORMAT_VERSION + 7))
    with BlockStore([str(d) for d in dirs], 16 * MiB) as store:
        assert len(store) == 0
        assert store.put(b"new", block(b"new", 8000)).ok
    for d in dirs:
        (aside,) = (d / "set-aside").iterdir()
        assert (aside / DATA).exists()


def test_read_only_view_refuses_another_version_and_moves_nothing(tmp_path: Path) -> None:
    version = _native.JOURNAL_FORMAT_VERSION + 1
    d = _copy_v1(tmp_path / "store", version=version)
    with pytest.raises(CorruptBlockError, match=f"format v{version}, this build reads"):
        BlockStore(str(d), 16 * MiB, read_only=True)
    assert not (d / "set-aside").exists() and (d / JOURNAL).exists()


def test_foreign_files_are_refused_and_left_alone(tmp_path: Path) -> None:
    for name in (JOURNAL, DATA):
        (tmp_path / name).write_bytes(b"not a flexkv file " * 100)
    for _ in range(2):  # the same clear error every time, nothing moved or rewritten
        with pytest.raises(CorruptBlockError, match="not a flexkv journal"):
            BlockStore(str(tmp_path), 16 * MiB)
    assert (tmp_path / JOURNAL).read_bytes() == b"not a flexkv file " * 100
    assert not (tmp_path / "set-aside").exists()


def _journal_version(directory: Path) -> int:
    with open(directory / JOURNAL, "rb") as f:
        f.seek(8)
        version: int = struct.unpack("<I", f.read(4))[0]
    return version


def _v3_reads_whole(store: BlockStore) -> None:
    assert set(V3_KEYS) <= set(store.keys())
    for k in V3_KEYS[:3]:
        assert store.read(k) == block(k, 8000)
    assert store.read(b"v3/d") == block(b"v3/a", 8000)


def test_v3_store_is_migrated_read_whole_and_rewritten_as_this_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert _native.JOURNAL_FORMAT_VERSION == 4
    d = tmp_path / "v3"
    shutil.copytree(V3, d)
    original = (d / JOURNAL).read_bytes()
    # A read-only view reads it as it is and rewrites nothing.
    with BlockStore(str(d), 16 * MiB, read_only=True) as view:
        assert sorted(view.keys()) == list(V3_KEYS)
        _v3_reads_whole(view)
    assert (d / JOURNAL).read_bytes() == original
    with caplog.at_level(logging.WARNING), BlockStore(str(d), 16 * MiB) as store:
        assert sorted(store.keys()) == list(V3_KEYS)
        _v3_reads_whole(store)
        assert store.stats()["unique_blocks"] == 3
        # v3's 8-byte tags were read as 6: the same bytes under a new key still dedup onto them.
        assert store.put(b"v4/b", block(b"v3/b", 8000)).ok
        assert store.stats()["deduped"] == 1 and store.stats()["unique_blocks"] == 3
        assert store.put(b"v4/new", block(b"v4/new", 8000)).ok
    assert _journal_version(d) == _native.JOURNAL_FORMAT_VERSION
    assert not (d / "set-aside").exists()
    assert not [r for r in caplog.records if "set-aside" in r.getMessage()]
    with BlockStore(str(d), 16 * MiB) as store:
        assert sorted(store.keys()) == sorted([*V3_KEYS, b"v4/b", b"v4/new"])
        _v3_reads_whole(store)
        assert store.read(b"v4/b") == block(b"v3/b", 8000)
        assert store.read(b"v4/new") == block(b"v4/new", 8000)
        assert store.stats()["unique_blocks"] == 4
    assert not (d / "set-aside").exists()
