"""The object tier wired into the coordinator (in-process engine, `file://` bucket): stores
reach the bucket by write-behind with their chain (manifests), another engine with an empty
host tier finds the chain with one lookup and loads the blocks from it bit-exactly; a missing
or corrupt object fails only that block (recompute) and the index forgets it; a bucket that
cannot be opened leaves the engine serving without it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages

from flexkv_py.coordinator import CacheEngine
from flexkv_py.errors import ConfigError
from flexkv_py.index import Tier

SLOTS = 16


def _object_config(tmp_path: Path, bucket: Path, **kw: Any) -> Any:
    bucket.mkdir(exist_ok=True)
    return _config(tmp_path, SLOTS, object_store_url=f"file://{bucket}", **kw)


def _stored_to_bucket(eng: CacheEngine, keys: list[bytes], pages: list[bytes]) -> None:
    assert eng.store_pages(keys, pages).statuses == ("ok",) * len(keys)
    assert eng.flush_write_behind(30.0, Tier.OBJECT) == 0
    assert eng.manager.stats()["object_write_behind_blocks"] == len(keys)


def _bucket_with(tmp_path: Path, n: int) -> tuple[Path, list[bytes], list[bytes]]:
    """A file:// bucket holding a chain of `n` blocks (one engine stored them, then closed)."""
    ns, bucket = _ns(), tmp_path / "bucket"
    keys = _keys(ns, n)
    pages = _pages(keys)
    with _engine(_object_config(tmp_path / "a", bucket), ns, SLOTS) as a:
        _stored_to_bucket(a, keys, pages)
    return bucket, keys, pages


def test_a_second_engine_loads_a_prefix_from_the_bucket(tmp_path: Path) -> None:
    ns = _ns()
    bucket, keys, pages = _bucket_with(tmp_path, 10)
    with _engine(_object_config(tmp_path / "b", bucket), ns, SLOTS) as b:
        assert b.lookup(keys) == 0  # an empty host tier, and nothing asked of the bucket yet
        assert b.lookup_object(keys) == 10  # the chain's manifests answer for all of it
        assert b.lookup_object(keys[:4] + _keys(ns, 3, "other")) == 4  # a prefix of it
        assert b.lookup(keys) == 10
        assert b.load_pages(keys) == pages
        stats = b.stats()
        assert stats["manager"]["load_object_blocks"] == 10
        assert stats["executor"]["object_read_blocks"] == 10
        assert b.lookup(keys) == 10 and b.load_pages(keys) == pages  # now from host


def test_a_lost_or_corrupt_object_fails_only_that_block(tmp_path: Path) -> None:
    ns = _ns()
    bucket, keys, pages = _bucket_with(tmp_path, 6)
    blocks = sorted(p for p in bucket.rglob("*") if p.is_file() and "/b/" in str(p))
    assert len(blocks) == 6
    by_key = {p.name: p for p in blocks}
    storage = [ns.storage_key(k).hex() for k in keys]
    lost, bad = by_key[storage[4]], by_key[storage[5]]
    os.unlink(lost)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with _engine(_object_config(tmp_path / "b", bucket), ns, SLOTS) as b:
        assert b.lookup_object(keys) == 6  # manifests still list every block
        got = b.load_pages(keys)
        assert got[:4] == pages[:4] and got[4] is None and got[5] is None
        assert b.lookup(keys) == 4  # the index forgot the two bad copies
        stats = b.stats()["manager"]
        assert stats["object_read_not_found_blocks"] == 1
        assert stats["object_read_corrupt_blocks"] == 1


def test_an_unreachable_bucket_serves_without_the_object_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id-not-printed")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-not-printed")
    ns = _ns()
    cfg = _config(
        tmp_path,
        SLOTS,
        object_store_url="s3://no-such-bucket/kv",
        object_store_endpoint="http://127.0.0.1:9",
        object_store_allow_http=True,
    )
    with caplog.at_level(logging.ERROR), _engine(cfg, ns, SLOTS) as eng:
        keys = _keys(ns, 3)
        assert eng.store_pages(keys, _pages(keys)).ok
        assert eng.lookup_object(keys) == 0
        assert eng.stats()["executor"]["object_unavailable"] == 1
        assert eng.flush_write_behind(5.0, Tier.OBJECT) == 0  # its writes fail fast
    text = caplog.text
    assert "object tier UNAVAILABLE" in text and "127.0.0.1:9" in text
    assert "secret-not-printed" not in text and "id-not-printed" not in text


def test_a_weak_engine_hash_is_refused_at_start(tmp_path: Path) -> None:
    cfg = _object_config(tmp_path, tmp_path / "bucket")
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo"):
        _engine(cfg, _ns(hash_algo="xxhash"), SLOTS)


def test_blocks_evicted_from_host_are_loaded_back_from_a_memory_bucket(tmp_path: Path) -> None:
    ns = _ns()
    cfg = _config(tmp_path, SLOTS, object_store_url="memory://")
    with _engine(cfg, ns, SLOTS) as eng:
        first = _keys(ns, 8, "first")
        pages = _pages(first)
        _stored_to_bucket(eng, first, pages)
        later = _keys(ns, SLOTS, "later")  # a second prompt fills the host tier
        assert eng.store_pages(later, _pages(later)).ok
        eng.flush()
        got = eng.load_pages(first)
        assert got == pages  # the evicted ones came back from the bucket, bit-exact
        stats = eng.stats()["manager"]
        assert stats["host_evicted_blocks"] >= 1
        assert stats["load_object_blocks"] >= 1


def test_object_write_behind_sends_ancestors_before_descendants(tmp_path: Path) -> None:
    from helpers.coordinator_util import PAGE_BYTES

    from flexkv_py.coordinator import CacheManager, JobResult, SpillJob

    ns = _ns()
    cfg = _config(tmp_path, 64, object_store_url="memory://")
    mgr = CacheManager(cfg, ns, PAGE_BYTES, free_target=0)
    keys = _keys(ns, 8)
    head = mgr.prepare_store(keys[:4], None)
    tail = mgr.prepare_store(keys[4:], None, parents=[keys[3], *keys[4:7]])
    assert head is not None and tail is not None
    mgr.complete(JobResult(tail.job_id, "store"))  # the tail's store commits first
    mgr.complete(JobResult(head.job_id, "store"))
    (job,) = mgr.take_jobs()
    assert isinstance(job, SpillJob) and job.tier is Tier.OBJECT
    assert job.keys == tuple(keys)  # root first: one chain, ancestors in the same batch
    assert job.leg.blocks.parents == (None, *keys[:7])
    assert mgr.take_jobs() == []  # one object write-behind at a time
    mgr.complete(JobResult(job.job_id, "spill"))
    assert all(mgr.index.readable_on(k, Tier.OBJECT) for k in keys)
    assert mgr.stats()["object_write_behind_blocks"] == 8
    more = _keys(ns, 3, "more")
    store = mgr.prepare_store(more, None, parents=[keys[7], *more[:2]])
    assert store is not None
    mgr.complete(JobResult(store.job_id, "store"))
    (cont,) = mgr.take_jobs()
    assert isinstance(cont, SpillJob) and cont.keys == tuple(more)
    assert cont.chain_links[:2] == ((keys[7], keys[6]), (keys[6], keys[5]))  # its ancestors
    assert len(cont.chain_links) == 8
