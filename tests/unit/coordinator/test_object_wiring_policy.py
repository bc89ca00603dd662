"""The object tier's policy in the coordinator (in-process engines, `file://` bucket): blocks
evicted from a small host tier before their upload turn reach the bucket from the SSD
(host -> SSD -> object), and a prefetch moves a bucket hit into host memory so that the load
reads host memory; a prefetched object that is corrupt or gone is not promoted and is forgotten
(a load recomputes it), never served."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages

from flexkv_py.index import Tier
from unit.coordinator.test_object_wiring import SLOTS, _bucket_with

HOST = 8  # host slots of the uploading engine
CHAINS, LENGTH = 5, 6


def _ssd_object_config(tmp_path: Path, bucket: Path, **kw: Any) -> Any:
    bucket.mkdir(exist_ok=True)
    tmp_path.mkdir(exist_ok=True)
    # A trickle of a write-behind rate: uploads wait, and the host tier turns over meanwhile.
    kw.setdefault("write_behind_mib_s", 0.0001)
    return _config(tmp_path, HOST, 64, object_store_url=f"file://{bucket}", **kw)


def test_blocks_evicted_before_their_upload_turn_are_uploaded_from_the_ssd(
    tmp_path: Path,
) -> None:
    ns, bucket = _ns(), tmp_path / "bucket"
    chains = [_keys(ns, LENGTH, f"chain{c}-") for c in range(CHAINS)]
    pages = [_pages(keys) for keys in chains]
    with _engine(_ssd_object_config(tmp_path / "a", bucket), ns, HOST) as a:
        for keys, chain_pages in zip(chains, pages, strict=True):
            assert a.store_pages(keys, chain_pages).ok
        assert a.flush_write_behind(60.0, Tier.OBJECT) == 0
        stats = a.stats()["manager"]
    total = CHAINS * LENGTH
    assert stats["object_write_behind_blocks"] == total
    # At most HOST blocks were still in host memory at the end, and the rate let one or two
    # go from host before: the rest came from the SSD.
    assert stats["object_write_behind_from_ssd_blocks"] >= total - HOST - 2
    assert stats.get("object_write_behind_stage_failed_blocks", 0) == 0
    with _engine(
        _config(tmp_path / "b", SLOTS, object_store_url=f"file://{bucket}"), ns, SLOTS
    ) as b:
        for keys, chain_pages in zip(chains, pages, strict=True):
            assert b.lookup_object(keys) == LENGTH  # manifests written for every chain
            assert b.load_pages(keys) == chain_pages  # bit-exact
        assert b.stats()["manager"]["load_object_blocks"] == total


def test_without_an_ssd_a_block_evicted_before_its_turn_is_counted_lost(tmp_path: Path) -> None:
    ns, bucket = _ns(), tmp_path / "bucket"
    bucket.mkdir()
    cfg = _config(tmp_path, HOST, object_store_url=f"file://{bucket}", write_behind_mib_s=0.0001)
    with _engine(cfg, ns, HOST) as a:
        for c in range(CHAINS):
            keys = _keys(ns, LENGTH, f"chain{c}-")
            assert a.store_pages(keys, _pages(keys)).ok
        assert a.flush_write_behind(60.0, Tier.OBJECT) == 0
        stats = a.stats()["manager"]
    assert stats["object_write_behind_lost_blocks"] >= 1
    assert stats.get("object_write_behind_from_ssd_blocks", 0) == 0
    assert stats["object_write_behind_blocks"] + stats["object_write_behind_lost_blocks"] == (
        CHAINS * LENGTH
    )


def test_a_prefetched_hit_is_loaded_from_host_and_read_from_the_bucket_once(
    tmp_path: Path,
) -> None:
    ns = _ns()
    bucket, keys, pages = _bucket_with(tmp_path, 10)
    with _engine(
        _config(tmp_path / "b", SLOTS, object_store_url=f"file://{bucket}"), ns, SLOTS
    ) as b:
        assert b.lookup_object(keys) == 10
        assert b.manager.prefetch_object(keys) is not None
        b.flush()  # the prefetch is a background job
        stats = b.stats()
        assert stats["manager"]["object_prefetch_blocks"] == 10
        assert stats["executor"]["object_read_blocks"] == 10
        assert b.load_pages(keys) == pages
        stats = b.stats()
        assert stats["manager"]["load_host_blocks"] == 10
        assert stats["manager"].get("load_object_blocks", 0) == 0
        assert stats["executor"]["object_read_blocks"] == 10  # not read again by the load
        assert b.manager.prefetch_object(keys) is None  # in host already: nothing to move


def test_a_prefetch_takes_at_most_its_cap_and_free_host_slots(tmp_path: Path) -> None:
    ns = _ns()
    bucket, keys, pages = _bucket_with(tmp_path, 10)
    cfg = _config(
        tmp_path / "b", SLOTS, object_store_url=f"file://{bucket}", object_store_prefetch_blocks=3
    )
    with _engine(cfg, ns, SLOTS) as b:
        assert b.lookup_object(keys) == 10
        assert b.manager.prefetch_object(keys) is not None
        b.flush()
        assert b.stats()["manager"]["object_prefetch_blocks"] == 3
        other = _keys(ns, SLOTS - 3, "other")  # fills the rest of the host tier
        assert b.store_pages(other, _pages(other)).ok
        b.flush()
        assert b.manager.index.free_slots <= b.manager.host.free_target
        assert b.manager.prefetch_object(keys[3:]) is None  # no free room: never evicts
        assert b.load_pages(keys) == pages  # the rest staged by the load itself
    off = _config(
        tmp_path / "c", SLOTS, object_store_url=f"file://{bucket}", object_store_prefetch_blocks=0
    )
    with _engine(off, ns, SLOTS) as c:
        assert c.lookup_object(keys) == 10
        assert c.manager.prefetch_object(keys) is None


def test_a_corrupt_or_missing_object_is_not_prefetched_and_is_forgotten(tmp_path: Path) -> None:
    ns = _ns()
    bucket, keys, pages = _bucket_with(tmp_path, 6)
    by_key = {p.name: p for p in bucket.rglob("*") if p.is_file() and "/b/" in str(p)}
    storage = [ns.storage_key(k).hex() for k in keys]
    os.unlink(by_key[storage[4]])
    bad = by_key[storage[5]]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with _engine(
        _config(tmp_path / "b", SLOTS, object_store_url=f"file://{bucket}"), ns, SLOTS
    ) as b:
        assert b.lookup_object(keys) == 6
        assert b.manager.prefetch_object(keys) is not None
        b.flush()
        stats = b.stats()["manager"]
        assert stats["object_prefetch_blocks"] == 4
        assert stats["object_prefetch_failed_blocks"] == 2
        assert stats["object_read_not_found_blocks"] == 1
        assert stats["object_read_corrupt_blocks"] == 1
        assert b.lookup(keys) == 4  # the bad copies are forgotten: never promised again
        assert b.load_pages(keys[:4]) == pages[:4]
