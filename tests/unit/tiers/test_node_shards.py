"""Reading a shard another process writes (tiers/node/shards.py) on real native stores: the
read-only snapshot finds blocks written after it was taken, and a block whose extent the
writer reused since is never served with the new bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.store_util import block

from flexkv_py._native import BlockStore, HostPool
from flexkv_py.config import load_config
from flexkv_py.tiers.node.shards import ReadOnlyShard, SiblingShards

SLOT = 64 * 1024
MiB = 1 << 20


@pytest.fixture
def pool() -> Iterator[tuple[HostPool, np.ndarray]]:
    p = HostPool(8 * SLOT)
    view = np.frombuffer(p.memoryview(), np.uint8)
    try:
        yield p, view
    finally:
        del view
        p.close()


def put(store: BlockStore, pool: HostPool, view: np.ndarray, keys: list[bytes]) -> None:
    for i, k in enumerate(keys):
        view[i * SLOT : (i + 1) * SLOT] = np.frombuffer(block(k, SLOT), np.uint8)
    items = [(k, (pool.address + i * SLOT, SLOT)) for i, k in enumerate(keys)]
    assert all(r.ok for r in store.submit_put(items).wait(10))


def get(store: BlockStore | SiblingShards, pool: HostPool, key: bytes) -> tuple[str, bytes]:
    (r,) = store.submit_get([(key, (pool.address + 7 * SLOT, SLOT))]).wait(10)
    return r.status, bytes(pool.memoryview()[7 * SLOT : 8 * SLOT])


def test_a_snapshot_is_reopened_when_the_writer_stored_more(
    tmp_path: Path, pool: tuple[HostPool, np.ndarray]
) -> None:
    p, view = pool
    cfg = load_config({"ssd_io_engine": "psync"}, env={})
    with BlockStore(str(tmp_path), 16 * MiB, io_engine="psync") as writer:
        put(writer, p, view, [b"a0", b"a1"])
        shard = ReadOnlyShard(cfg, [str(tmp_path)])
        try:
            first = shard.store()
            assert first is not None and sorted(first.keys()) == [b"a0", b"a1"]
            assert shard.fresh() is first  # the journal did not change: no reopen
            put(writer, p, view, [b"a2"])
            assert get(first, p, b"a2")[0] == "not_found"  # after the snapshot
            again = shard.fresh()
            assert again is first  # followed: the appended records applied, no reopen
            status, data = get(again, p, b"a2")
            assert status == "ok" and data == block(b"a2", SLOT)
        finally:
            shard.close()


def test_an_extent_reused_since_the_snapshot_is_never_served(
    tmp_path: Path, pool: tuple[HostPool, np.ndarray]
) -> None:
    """The writer evicts a block and writes another into its extent: the old snapshot still
    maps the old key there, and its read fails the header check instead of serving the new
    block's bytes under the old key."""
    p, view = pool
    cfg = load_config({"ssd_io_engine": "psync"}, env={})
    # Room for a few blocks only: new puts evict the oldest and reuse their extents.
    with BlockStore(str(tmp_path), 1 * MiB, io_engine="psync", preallocate=False) as writer:
        put(writer, p, view, [b"old%d" % i for i in range(4)])
        shard = ReadOnlyShard(cfg, [str(tmp_path)])
        try:
            snap = shard.store()
            assert snap is not None
            for n in range(6):  # enough to evict every old block
                put(writer, p, view, [b"new%d-%d" % (n, i) for i in range(4)])
            assert not set(writer.keys()) & {b"old%d" % i for i in range(4)}
            # Every old extent holds a new block now: each read is refused as corrupt.
            assert [get(snap, p, b"old%d" % i)[0] for i in range(4)] == ["corrupt"] * 4
        finally:
            shard.close()


class _Plain:
    """A namespace whose storage keys are the logical keys (as a real one's, minus the tag)."""

    @staticmethod
    def storage_key(key: bytes) -> bytes:
        return key

    @staticmethod
    def logical_key(key: bytes) -> bytes | None:
        return key


def test_sibling_refresh_reports_what_came_and_went_across_siblings(
    tmp_path: Path, pool: tuple[HostPool, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SiblingShards.refresh: keys a sibling stored since are reported added, keys it deleted
    removed, except a key another sibling still holds; an unchanged sibling reports nothing."""
    p, view = pool
    cfg = load_config({"ssd_io_engine": "psync"}, env={})
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    with (
        BlockStore(str(a_dir), 16 * MiB, io_engine="psync") as a,
        BlockStore(str(b_dir), 16 * MiB, io_engine="psync") as b,
    ):
        put(a, p, view, [b"x", b"both"])
        put(b, p, view, [b"both"])
        monkeypatch.setattr(SiblingShards, "refresh_s", 3600.0)  # refreshed by hand here
        sibs = SiblingShards(
            _Plain(),  # type: ignore[arg-type]
            [ReadOnlyShard(cfg, [str(a_dir)]), ReadOnlyShard(cfg, [str(b_dir)])],
        )
        try:
            added, removed = sibs.take_changes()
            assert sorted(added) == [b"both", b"x"] and removed == ()
            sibs.refresh()
            assert sibs.take_changes() == ((), ())  # nothing changed
            put(a, p, view, [b"y"])
            assert a.delete(b"x") and a.delete(b"both")
            sibs.refresh()
            assert sibs.take_changes() == ((b"y",), (b"x",))  # "both": b still holds it
            assert sorted(sibs.keys()) == [b"both", b"y"]
            assert b.delete(b"both")
            sibs.refresh()
            assert sibs.take_changes() == ((), (b"both",))
            a.checkpoint()  # a compacted journal: the view is reopened and compared whole
            put(a, p, view, [b"z"])
            sibs.refresh()
            assert sibs.take_changes() == ((b"z",), ())
            status, data = get(sibs, p, b"y")
            assert status == "ok" and data == block(b"y", SLOT)
            assert get(sibs, p, b"x")[0] == "not_found"
        finally:
            sibs.close()


def test_a_read_only_view_follows_the_writers_journal(
    tmp_path: Path, pool: tuple[HostPool, np.ndarray]
) -> None:
    """BlockStore.follow: the records a writer appended since are applied to the read-only view
    (what came, what went), a compacted journal cannot be followed (None: reopen), and only a
    read-only view follows."""
    p, view = pool
    with BlockStore(str(tmp_path), 16 * MiB, io_engine="psync") as writer:
        put(writer, p, view, [b"a", b"b"])
        ro = BlockStore(str(tmp_path), 0, io_engine="psync", read_only=True)
        try:
            assert ro.follow() == ([], [])
            put(writer, p, view, [b"c"])
            assert writer.delete(b"a")
            put(writer, p, view, [b"d"])
            assert writer.delete(b"d")  # came and went: not reported
            came, gone = ro.follow() or ([], [])
            assert (sorted(came), gone) == ([b"c"], [b"a"])
            assert sorted(ro.keys()) == [b"b", b"c"]
            status, data = get(ro, p, b"c")
            assert status == "ok" and data == block(b"c", SLOT)
            writer.checkpoint()  # the journal is replaced: this view cannot follow it
            assert ro.follow() is None
            with pytest.raises(Exception, match="read-only"):
                writer.follow()
        finally:
            ro.close()
