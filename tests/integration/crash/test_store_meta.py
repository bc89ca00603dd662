"""Per-block chain parents and metadata in the SSD store: kept across reopen, compaction and
kill -9, read back in batches, bounded by the header page, never confused between keys."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers.store_util import block, start_writer
from helpers.writers.meta_writer import meta_of

from flexkv_py._native import BlockStore
from flexkv_py.integration.vllm.recovered_events import RecoveredMetaReader

MiB = 1 << 20


def _put_chain(store: BlockStore, keys: list[bytes], metas: list[bytes | None]) -> None:
    parents: list[bytes | None] = [None, *keys[:-1]]
    items = [(k, block(k, 8000)) for k in keys]
    results = store.submit_put(items, parents=parents, metas=metas).wait()
    assert all(r.ok for r in results), results


def test_parents_and_metas_survive_reopen_and_compaction(tmp_path: Path) -> None:
    keys = [b"chain/%d" % i for i in range(6)]
    metas: list[bytes | None] = [b"ids-%d" % i for i in range(5)] + [None]
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        _put_chain(store, keys, metas)
        assert store.put(b"lonely", block(b"lonely", 8000)).ok
        expected = [(k, p) for k, p in zip(keys, [None, *keys[:-1]], strict=True)] + [
            (b"lonely", None)
        ]
        assert store.inventory() == expected
        assert store.read_metas([*keys, b"lonely", b"absent"]) == [*metas, None, None]
        store.checkpoint()  # a compacted journal is rewritten from memory: parents included
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        assert store.inventory() == expected
        assert store.read_metas(keys) == metas
        # The store keeps no access order: a read changes nothing, listings stay in write
        # order, and links resolve on replay whatever order the compacted journal has.
        assert store.read(keys[0]) == block(keys[0], 8000)
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        inv = dict(store.inventory())
        assert store.inventory() == expected
        assert inv[keys[1]] == keys[0] and inv[keys[0]] is None


def test_parent_link_drops_when_the_parent_is_deleted(tmp_path: Path) -> None:
    keys = [b"p/a", b"p/b"]
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        _put_chain(store, keys, [b"a", b"b"])
        assert store.delete(b"p/a")
        assert store.put(b"p/other", block(b"p/other", 8000)).ok  # may reuse p/a's record
        assert store.inventory() == [(b"p/b", None), (b"p/other", None)]
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        assert dict(store.inventory())[b"p/b"] is None


def test_meta_of_a_duplicate_is_its_own_across_restarts(tmp_path: Path) -> None:
    """A put deduplicated onto another key's content keeps its own metadata (side file), never
    the content owner's: across a reopen, a compaction of the journal, the owner's delete, and
    for duplicates within one batch."""
    data = block(b"same", 8000)
    other = block(b"other", 8000)
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        store.submit_put([(b"first", data)], metas=[b"first-meta"]).wait()
        r = store.submit_put([(b"second", data)], parents=[b"first"], metas=[b"second-meta"])
        assert r.wait()[0].status == "deduped"
        # One batch: the follower maps onto its leader's content.
        got = store.submit_put([(b"lead", other), (b"follow", other)], metas=[b"l", b"f"]).wait()
        assert [x.status for x in got] == ["ok", "deduped"]
        store.submit_put([(b"bare", data)]).wait()  # deduplicated, without metadata
        assert store.read_metas([b"first", b"second", b"lead", b"follow", b"bare"]) == [
            b"first-meta",
            b"second-meta",
            b"l",
            b"f",
            None,
        ]
        assert dict(store.inventory())[b"second"] == b"first"
        store.checkpoint()
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        # What a restarted worker announces (recovered_events.py reads these in the background).
        reader = RecoveredMetaReader(store, [b"first", b"second", b"bare"], "test")
        assert reader.done.wait(10)
        assert reader.take() == {b"first": b"first-meta", b"second": b"second-meta"}
        assert store.read_metas([b"first", b"second", b"follow", b"bare"]) == [
            b"first-meta",
            b"second-meta",
            b"f",
            None,
        ]
        assert store.delete(b"first")  # the content stays (second maps onto it)
        assert store.read_metas([b"second", b"first"]) == [b"second-meta", None]
        # Mapped again, now without metadata: the older record must not come back.
        assert store.delete(b"follow")
        store.submit_put([(b"follow", other)]).wait()
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        assert store.read_metas([b"second", b"follow", b"lead"]) == [b"second-meta", None, b"l"]
        assert store.read(b"second") == data


def test_dedup_side_file_is_rewritten_with_live_keys_only(tmp_path: Path) -> None:
    """The side file does not grow without bound: once past its floor it is rewritten with the
    records of keys still stored, and every live key's metadata survives that."""
    data = block(b"shared", 8000)
    side = tmp_path / "flexkv-dedup-metas.log"
    meta = b"t" * 2000
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        store.submit_put([(b"owner", data)], metas=[b"o"]).wait()
        for i in range(700):  # ~1.4 MB of records, each key deleted again but the last 10
            key = b"dup/%d" % i
            assert store.submit_put([(key, data)], metas=[meta + b"%d" % i]).wait()[0].ok
            if i < 690:
                assert store.delete(key)
        assert side.stat().st_size < 700 * 2000  # rewritten on the way
        assert oct(side.stat().st_mode & 0o777) == oct(0o600)
        want = [b"dup/%d" % i for i in range(690, 700)]
        assert store.read_metas(want) == [meta + b"%d" % i for i in range(690, 700)]


def test_bad_parents_or_metas_are_refused_clearly(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        data = block(b"x", 8000)
        with pytest.raises(Exception, match="metas has 2 entries for 1 items"):
            store.submit_put([(b"x", data)], metas=[b"a", b"b"])
        with pytest.raises(Exception, match="does not fit the header page"):
            store.submit_put([(b"x", data)], metas=[b"m" * 4096])
        biggest = b"m" * (4096 - 63 - 1)  # the header page's room beside a 1-byte key
        assert store.submit_put([(b"x", data)], metas=[biggest]).wait()[0].ok
        assert store.read_metas([b"x"]) == [biggest]
        assert len(store) == 1


def test_sigkill_keeps_every_acknowledged_blocks_meta_and_parent(tmp_path: Path) -> None:
    acked: list[bytes] = []
    start = 0
    for _round in range(3):
        proc = start_writer("meta_writer.py", str(tmp_path), str(start))
        assert proc.stdout is not None
        for line in proc.stdout:
            acked.append(line.split()[1].encode())
            if len(acked) >= 40 * (_round + 1):
                break
        proc.send_signal(signal.SIGKILL)
        acked += [line.split()[1].encode() for line in proc.stdout.read().splitlines()]
        proc.wait()
        with BlockStore(str(tmp_path), 512 * MiB) as store:
            assert store.stats()["last_clean_shutdown_unix"] == 0  # it was a crash
            inv = dict(store.inventory())
            assert set(acked) <= set(inv)
            assert store.read_metas(acked) == [meta_of(k) for k in acked]
            for k in acked:
                n = int(k[1:])
                assert inv[k] == (b"m%d" % (n - 1) if n % 8 else None), k
            start = (max(int(k[1:]) for k in inv) // 8 + 1) * 8  # batches stay 8-aligned
