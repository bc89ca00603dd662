"""Coordinator: manager + executor + engine over a real host pool and the real native SSD store.

Every page is deterministic pseudo-random bytes derived from its key, so any mix-up of blocks,
slots, ranks or namespaces shows up as a byte mismatch.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.coordinator_util import PAGE_BYTES, _config, _engine, _keys, _ns, _pages
from helpers.store_util import DATA_FILE, PAGE, block, flip_byte, stored_blocks
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator import (
    CacheEngine,
    CacheManager,
    DropJob,
    JobExecutor,
    JobResult,
    KVEvent,
    LoadJob,
    SpillJob,
    StoreJob,
    host_slots_for,
)
from flexkv_py.coordinator.engine import pipeline_parts
from flexkv_py.index import Namespace, Tier
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer import describe_kv_caches


# ---------------------------------------------------------------- host tier
def test_host_tier_round_trip(tmp_path: Path) -> None:
    ns = _ns()
    with _engine(_config(tmp_path, 16), ns, 16) as eng:
        keys = _keys(ns, 10)
        pages = _pages(keys)
        assert eng.store_pages(keys, pages).statuses == ("ok",) * 10
        assert eng.lookup(keys) == 10
        # storing again is a no-op
        assert eng.store_pages(keys[:3], pages[:3]).statuses == ("cached",) * 3
        order = random.Random(1).sample(range(10), 10)
        got = eng.load_pages([keys[i] for i in order])
        assert got == [pages[i] for i in order]
        assert eng.manager.index.match(keys) == [Tier.HOST] * 10
        stats = eng.stats()["manager"]
        assert stats["load_host_blocks"] == 10 and stats["stored_blocks"] == 10


def test_host_only_eviction_drops_lru(tmp_path: Path) -> None:
    ns = _ns()
    with _engine(_config(tmp_path, 4), ns, 4, free_target=0) as eng:
        keys = _keys(ns, 6)
        pages = _pages(keys)
        for k, p in zip(keys[:4], pages[:4], strict=True):  # four unrelated blocks (no chain)
            eng.store_pages([k], [p])
        assert eng.load_pages(keys[:1]) == pages[:1]  # block 0 is now most recently used
        assert eng.store_pages(keys[4:], pages[4:]).statuses == ("ok", "ok")
        assert eng.lookup(keys[:1]) == 1
        assert eng.lookup(keys[1:2]) == 0 and eng.lookup(keys[2:3]) == 0  # LRU victims
        assert eng.load_pages([keys[0], keys[3], keys[4], keys[5]]) == [
            pages[0],
            pages[3],
            pages[4],
            pages[5],
        ]


# ---------------------------------------------------------------- SSD tier
def test_eviction_cascade_host_to_ssd_and_reload(tmp_path: Path) -> None:
    ns = _ns()
    # The eviction path alone (no write-behind): blocks reach the SSD as they leave host.
    with _engine(_config(tmp_path, 8, 64, write_behind_lag_s=0), ns, 8) as eng:
        keys = _keys(ns, 24)
        pages = _pages(keys)
        assert eng.store_pages(keys, pages).ok
        eng.flush()
        tiers = eng.manager.index.match(keys)
        assert len(tiers) == 24
        assert tiers.count(Tier.SSD) >= 16 and tiers.count(Tier.HOST) <= 8
        assert Tier.SSD in eng.executor.tiers
        for k, t in zip(keys, tiers, strict=True):
            assert (t is Tier.SSD) <= eng.executor.tiers[Tier.SSD].contains(k)
        for start in range(0, 24, 6):  # loads stage SSD blocks through host slots
            assert eng.load_pages(keys[start : start + 6]) == pages[start : start + 6]
        stats = eng.stats()["manager"]
        assert stats["spilled_blocks"] >= 16
        assert stats["load_ssd_blocks"] >= 16 and stats.get("load_failed_blocks", 0) == 0


def test_write_through_copies_at_store_time(tmp_path: Path) -> None:
    ns = _ns()
    cfg = _config(tmp_path, 4, 32, admission="write_through")
    with _engine(cfg, ns, 4, free_target=0) as eng:
        keys = _keys(ns, 8)
        pages = _pages(keys)
        assert eng.store_pages(keys[:4], pages[:4]).ok
        assert Tier.SSD in eng.executor.tiers
        assert all(eng.executor.tiers[Tier.SSD].contains(k) for k in keys[:4])
        assert eng.store_pages(keys[4:], pages[4:]).ok  # evicts the first four: no spill needed
        eng.flush()
        stats = eng.stats()["manager"]
        assert stats.get("spilled_blocks", 0) == 0 and stats["ssd_written_blocks"] == 8
        assert eng.manager.index.match(keys[:4]) == [Tier.SSD] * 4
        assert eng.load_pages(keys[:4]) == pages[:4]


def test_min_hits_admission(tmp_path: Path) -> None:
    ns = _ns()
    cfg = _config(tmp_path, 4, 32, admission="min_hits:2")
    with _engine(cfg, ns, 4, free_target=0) as eng:
        hot, cold, new = _keys(ns, 4, "hot"), _keys(ns, 4, "cold"), _keys(ns, 8, "new")
        eng.store_pages(hot, _pages(hot))
        assert eng.load_pages(hot) == _pages(hot)  # second access: hot blocks reach 2 hits
        eng.store_pages(cold, _pages(cold))  # evicts hot -> spilled (2 hits)
        eng.flush()
        eng.store_pages(new[:4], _pages(new[:4]))  # evicts cold -> dropped (1 hit)
        eng.flush()
        assert eng.manager.index.match(hot) == [Tier.SSD] * 4
        assert eng.lookup(cold) == 0
        assert eng.load_pages(hot) == _pages(hot)
        assert Tier.SSD in eng.executor.tiers
        assert not any(eng.executor.tiers[Tier.SSD].contains(k) for k in cold)


def test_restart_persistence_and_namespace_isolation(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 8, 64, admission="write_through")
    ns_a, ns_b = _ns("model-a"), _ns("model-b")
    hashes = [f"h{i}".encode().ljust(32, b"-") for i in range(6)]
    keys_a, keys_b = ns_a.keys(hashes), ns_b.keys(hashes)
    pages_a, pages_b = _pages(keys_a, b"a"), _pages(keys_b, b"b")
    with _engine(cfg, ns_a, 8) as eng:
        assert eng.store_pages(keys_a, pages_a).ok
    with _engine(cfg, ns_b, 8) as eng:  # same dirs, other model: sees nothing
        assert eng.lookup(keys_b) == 0
        assert eng.stats()["manager"]["ssd_adopted_blocks"] == 0
        assert eng.store_pages(keys_b, pages_b).ok
    with _engine(cfg, ns_a, 8) as eng:  # model A again: its blocks come back from SSD
        assert eng.stats()["manager"]["ssd_adopted_blocks"] == 6
        assert eng.manager.index.match(keys_a) == [Tier.SSD] * 6
        assert eng.load_pages(keys_a) == pages_a


def test_tp_ranks_do_not_share_blocks(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 32, admission="write_through", world=2)
    ns = _ns(tp_size=2)
    keys = _keys(ns, 3)
    with _engine(cfg, ns.for_rank(0), 4) as eng:
        assert eng.store_pages(keys, _pages(keys, b"rank0")).ok
    with _engine(cfg, ns.for_rank(1), 4) as eng:
        assert eng.lookup(keys) == 0
    assert (tmp_path / "ssd" / "tp0-pp0").is_dir() and (tmp_path / "ssd" / "tp1-pp0").is_dir()


# ---------------------------------------------------------------- failures
def _corrupt(tmp_path: Path, ns: Namespace, key: bytes) -> None:
    shard = tmp_path / "ssd" / ns.shard_dir_name
    offset = stored_blocks(shard)[ns.storage_key(key)]
    flip_byte(shard / DATA_FILE, offset + PAGE + 123)  # first payload page


def test_corrupt_ssd_block_is_a_per_block_failure(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 8, 64, admission="write_through")
    ns = _ns()
    keys = _keys(ns, 4)
    pages = _pages(keys)
    with _engine(cfg, ns, 8) as eng:
        assert eng.store_pages(keys, pages).ok
    _corrupt(tmp_path, ns, keys[1])
    with _engine(cfg, ns, 8) as eng:
        assert eng.lookup(keys) == 4  # the index cannot know yet
        out = eng.submit_load(keys, None).result()
        assert out.statuses == ("ok", "corrupt", "ok", "ok")
        assert out.source_tiers == ("ssd",) * 4
        assert eng.lookup(keys) == 1  # the bad block was dropped from the index
        assert eng.load_pages([keys[0], keys[2], keys[3]]) == [pages[0], pages[2], pages[3]]
        # it can be stored again and then reads back intact
        assert eng.store_pages(keys[1:2], pages[1:2]).ok
        assert eng.lookup(keys) == 4
        assert eng.load_pages(keys) == pages


def test_vanished_ssd_block_is_not_found(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 32, admission="write_through")
    ns = _ns()
    keys = _keys(ns, 3)
    with _engine(cfg, ns, 4) as eng:
        assert eng.store_pages(keys, _pages(keys)).ok
    with _engine(cfg, ns, 4) as eng:
        assert Tier.SSD in eng.executor.tiers
        assert eng.executor.tiers[Tier.SSD].delete([keys[0]]) == 1  # behind the manager's back
        got = eng.load_pages(keys)
        assert got[0] is None and got[1:] == _pages(keys)[1:]
        assert eng.lookup(keys) == 0
        assert eng.stats()["manager"]["ssd_read_not_found_blocks"] == 1


def test_ssd_capacity_evictions_reach_the_index(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 2, 6, admission="write_through")
    ns = _ns()
    keys = _keys(ns, 20)
    pages = _pages(keys)
    with _engine(cfg, ns, 2, free_target=0) as eng:
        for i in range(0, 20, 2):
            assert eng.store_pages(keys[i : i + 2], pages[i : i + 2]).ok
        eng.flush()
        assert eng.stats()["manager"]["ssd_evicted_blocks"] > 0
        indexed = [k for k in keys if eng.manager.index.lookup([k])]
        assert 0 < len(indexed) <= 8
        for k in indexed:  # every block the index still promises really loads
            # (a load makes room in host, whose victim may take an SSD block's place)
            if eng.manager.index.lookup([k]):
                assert eng.load_pages([k]) == [pages[keys.index(k)]]
        assert eng.stats()["manager"].get("load_failed_blocks", 0) == 0
        # The index chose every SSD eviction; the store's own (a safety net) never fired.
        assert eng.stats()["manager"].get("ssd_store_evicted_blocks", 0) == 0


def test_load_of_unknown_blocks_reports_missing(tmp_path: Path) -> None:
    ns = _ns()
    with _engine(_config(tmp_path, 4), ns, 4) as eng:
        keys = _keys(ns, 3)
        eng.store_pages(keys[:1], _pages(keys[:1]))
        out = eng.submit_load(keys, None).result()
        assert out.statuses == ("ok", "missing", "missing")
        assert out.source_tiers == ("host", "none", "none")


# ---------------------------------------------------------------- concurrency
def test_concurrent_submitters(tmp_path: Path) -> None:
    ns = _ns()
    cfg = _config(tmp_path, 64, 512)
    shared = _keys(ns, 5, "shared")
    errors: list[BaseException] = []
    retry: list[bytes] = []
    with _engine(cfg, ns, 64) as eng:

        def worker(t: int) -> None:
            try:
                own = _keys(ns, 30, f"t{t}-")
                for start in range(0, 30, 5):
                    chunk = own[start : start + 5]
                    out = eng.store_pages(shared + chunk, _pages(shared + chunk))
                    assert all(s in ("ok", "cached") for s in out.statuses), out
                for start in range(0, 30, 5):
                    chunk = own[start : start + 5]
                    got = eng.load_pages(chunk)
                    for k, want, page in zip(chunk, _pages(chunk), got, strict=True):
                        if page is None:  # evicted by another thread, spill not yet confirmed
                            retry.append(k)
                        else:
                            assert page == want, f"thread {t}: wrong bytes"
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        eng.flush()
        assert eng.load_pages(shared) == _pages(shared)
        # A block can be briefly unreadable while a job writes it out; once quiet, all load.
        assert len(retry) < 60
        for start in range(0, len(retry), 5):
            assert eng.load_pages(retry[start : start + 5]) == _pages(retry[start : start + 5])
        counts = eng.manager.index.counts()
        assert counts["pinned"] == 0 and counts["host_filling"] == 0
        assert eng.stats()["manager"]["spilled_blocks"] > 0  # 125 blocks through 64 slots


# ---------------------------------------------------------------- GPU-shaped caches
def _vllm_caches(layout: str, num_blocks: int = 24, num_layers: int = 3) -> dict[str, torch.Tensor]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    kv_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, kv_layout)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * num_blocks * num_layers,
                layers=names,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), kv_layout)
    gen = torch.Generator().manual_seed(len(layout))
    for view in caches.values():
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    return caches


def _legacy_fa_caches(num_blocks: int = 24) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        f"layers.{i}": torch.randn((2, num_blocks, 16, 2, 64), generator=gen).to(torch.float16)
        for i in range(3)
    }


def _block(t: torch.Tensor, b: int, legacy: bool) -> torch.Tensor:
    return (t[:, b] if legacy else t[b]).view(torch.int16)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "legacy_fa"])
def test_gpu_shaped_round_trip_through_host_and_ssd(tmp_path: Path, layout: str) -> None:
    legacy = layout == "legacy_fa"
    caches = _legacy_fa_caches() if legacy else _vllm_caches(layout)
    geom = describe_kv_caches(caches)
    ns = _ns(kv_layout=geom.layout, page_bytes=geom.page_nbytes)
    cfg = _config(tmp_path, 6, 64, slot=geom.slot_nbytes)
    assert host_slots_for(cfg, ns, geom.page_nbytes) == 6
    src = [17, 3, 9, 0, 12, 19, 5, 22, 8, 14, 1, 20]
    dst = [2, 18, 4, 11, 6, 23, 10, 7, 21, 13, 15, 16]
    keys = _keys(ns, len(src))
    before = {n: t.clone() for n, t in caches.items()}
    with CacheEngine.from_kv_caches(cfg, ns, caches) as eng:
        assert eng.store(keys, src).ok
        eng.flush()
        tiers = eng.manager.index.match(keys)
        assert Tier.SSD in tiers and Tier.HOST in tiers  # 12 blocks, 6 host slots
        for t in caches.values():  # poison the destinations
            for b in dst:
                (t[:, b] if legacy else t[b]).fill_(-3.0)
        out = eng.load(keys[6:], dst[6:])  # mostly still in host
        assert out.statuses == ("ok",) * 6 and "host" in out.source_tiers
        out = eng.load(keys[:6], dst[:6])  # spilled: staged through host slots
        assert out.statuses == ("ok",) * 6 and out.source_tiers == ("ssd",) * 6
    for name, t in caches.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(_block(t, d, legacy), _block(before[name], s, legacy)), (name, s)
        for b in set(range(24)) - set(dst):
            assert torch.equal(_block(t, b, legacy), _block(before[name], b, legacy))


def test_long_store_and_load_run_in_parts_bit_exact(tmp_path: Path) -> None:
    # 300 blocks: the store and the host load each run as several jobs (pipeline_parts); every
    # block still lands exactly, the load's blocks are pinned before the first part runs, and a
    # load that reaches the SSD tier stays one job.
    n = 300
    caches = _vllm_caches("LBNHC", num_blocks=2 * n + 2)
    geom = describe_kv_caches(caches)
    ns = _ns(page_bytes=geom.page_nbytes)
    cfg = _config(tmp_path, 2 * n, slot=geom.slot_nbytes)  # the 5 % reserve evicts nothing
    assert len(pipeline_parts(n)) > 1
    keys = _keys(ns, n)
    src, dst = list(range(n)), list(range(n + 1, 2 * n + 1))
    before = {name: t.clone() for name, t in caches.items()}
    with CacheEngine.from_kv_caches(cfg, ns, caches) as eng:
        assert eng.store(keys, src).ok
        parts = eng.manager.prepare_load_parts(keys, dst, pipeline_parts(n))
        assert len(parts) == len(pipeline_parts(n))
        pins = [eng.manager.index.entry(k) for k in keys]
        assert all(e is not None and e.pins == 1 for e in pins)  # all pinned up front
        for job in parts:
            eng.manager.complete(JobResult(job.job_id, "load"))
        pins = [eng.manager.index.entry(k) for k in keys]
        assert all(e is not None and e.pins == 0 for e in pins)
        out = eng.load(keys, dst)
        assert out.statuses == ("ok",) * n and out.source_tiers == ("host",) * n
    for name, t in caches.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(t[d].view(torch.int16), before[name][s].view(torch.int16))


def test_gpu_transfer_failure_fails_the_blocks(tmp_path: Path) -> None:
    caches = _vllm_caches("LBNHC")
    geom = describe_kv_caches(caches)
    ns = _ns(page_bytes=geom.page_nbytes)
    cfg = _config(tmp_path, 4, slot=geom.slot_nbytes)
    with CacheEngine.from_kv_caches(cfg, ns, caches) as eng:
        keys = _keys(ns, 2)
        out = eng.store(keys, [1, 999])  # 999 is not a GPU block
        assert out.statuses == ("transfer_error", "transfer_error")
        assert eng.lookup(keys) == 0 and eng.manager.index.free_slots == 4
        assert eng.store(keys, [1, 2]).ok
        out = eng.load(keys, [3, 999])
        assert out.statuses == ("transfer_error", "transfer_error")
        assert eng.lookup(keys) == 2  # the host copies are fine; only the copy failed


# ---------------------------------------------------------------- split deployment (TP=2)
class _Rank:
    """One worker: its own host pool, SSD subdirectory and executor."""

    def __init__(self, cfg: FlexKVConfig, ns: Namespace, slots: int) -> None:
        self.ns = ns
        self.pool = HostPool(slots, PAGE_BYTES, pin=False)
        self.ex = JobExecutor(cfg, ns, self.pool)

    def page(self, key: bytes) -> bytes:
        return block(self.ns.shard_tag + key, PAGE_BYTES)

    def run(self, wire: bytes, fill: bool = False) -> bytes:
        job = pickle.loads(wire)

        def write_pages() -> None:  # host-only store: this rank's shard of each block
            for k, s in zip(job.keys, job.host_slots, strict=True):
                self.pool.tensor[s].numpy()[:] = memoryview(self.page(k))

        result = self.ex.submit(job, write_pages if fill else None).wait(timeout=30)
        assert self.ex.wait([job.job_id]) == [result]
        return pickle.dumps(result)

    def slot_bytes(self, slot: int) -> bytes:
        return self.pool.tensor[slot].numpy().tobytes()


def test_split_manager_and_tp_executors(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 32, world=2)
    ns = _ns(tp_size=2)
    mgr = CacheManager(cfg, ns, PAGE_BYTES, free_target=0)
    assert mgr.num_host_slots == 4
    ranks = [_Rank(cfg, ns.for_rank(r), 4) for r in range(2)]

    def run(job: Any, fill: bool = False) -> JobResult:
        wire = pickle.dumps(job)
        merged = JobResult.merge([pickle.loads(r.run(wire, fill)) for r in ranks])
        mgr.complete(merged)
        return merged

    def drain() -> None:
        for job in mgr.take_jobs():
            assert isinstance(job, (SpillJob, DropJob))
            assert run(job).ok

    keys = _keys(ns, 8)
    job = mgr.prepare_store(keys[:4], None)
    assert isinstance(job, StoreJob) and job.keys == tuple(keys[:4])
    assert mgr.lookup(keys) == 0  # not readable while in flight
    assert mgr.prepare_store(keys[:4], None) is None  # in flight: nothing to do
    assert run(job, fill=True).ok
    assert mgr.lookup(keys) == 4
    # Host full (write-back): the job first writes the victims to SSD, then reuses their slots.
    job2 = mgr.prepare_store(keys[4:], None)
    assert job2 is not None and len(job2.keys) == 4
    assert set(job2.spill.keys) == set(keys[:4])
    assert job2.spill.src.places() is not None
    assert set(job2.spill.src.places()) == set(job.host_slots)
    assert mgr.lookup(keys) == 0  # victims are not readable until their spill is confirmed
    assert run(job2, fill=True).ok
    drain()
    assert mgr.index.match(keys) == [Tier.SSD] * 4 + [Tier.HOST] * 4

    load = mgr.prepare_load(keys[:2] + keys[6:], None)
    assert isinstance(load, LoadJob) and load.sources == (Tier.SSD, Tier.SSD, Tier.HOST, Tier.HOST)
    wire = pickle.dumps(load)
    results = [pickle.loads(r.run(wire)) for r in ranks]
    for r in ranks:  # each rank got its own shard of every block
        for k, s in zip(load.keys, load.host.slots, strict=True):
            assert r.slot_bytes(s) == r.page(k)
    mgr.complete(JobResult.merge(results))
    drain()

    # One rank loses a block: the merged result fails it and the manager forgets it.
    assert Tier.SSD in ranks[1].ex.tiers and ranks[1].ex.tiers[Tier.SSD].delete([keys[2]]) == 1
    load = mgr.prepare_load(keys[2:4], [7, 8])
    assert load is not None and load.sources == (Tier.SSD, Tier.SSD)
    results = []
    for r in ranks:
        job_r = pickle.loads(pickle.dumps(load))
        job_r = dataclasses.replace(job_r, gpu=None)
        results.append(r.ex.submit(job_r).wait(timeout=30))
    merged = JobResult.merge(results)
    assert merged.failed == {keys[2]: "not_found"} and not results[0].failed
    mgr.complete(merged)
    assert mgr.lookup(keys[2:4]) == 0 and mgr.lookup(keys[3:4]) == 1

    # Restart inventory: blocks only one rank holds are orphans and get deleted.
    inv = [r.ex.stored_keys() for r in ranks]
    fresh = CacheManager(cfg, ns, PAGE_BYTES)
    adopted = fresh.adopt_ssd_keys(inv)
    assert adopted == len(set(inv[0]) & set(inv[1])) and keys[2] not in set(inv[1])
    (drop,) = fresh.take_jobs()
    assert isinstance(drop, DropJob) and drop.keys == (keys[2],)
    for r in ranks:
        r.ex.shutdown()
        r.pool.close()


def test_events_carry_engine_block_hashes(tmp_path: Path) -> None:
    ns = _ns()
    cfg = _config(tmp_path, 2, 16, write_behind_lag_s=0)  # the spill announces the SSD copy
    with _engine(cfg, ns, 2, free_target=0) as eng:
        hashes = [f"e{i}".encode().ljust(32, b"_") for i in range(3)]
        keys = ns.keys(hashes)
        eng.store_pages(keys[:2], _pages(keys[:2]))
        assert eng.manager.take_events() == [KVEvent("stored", h, "CPU") for h in hashes[:2]]
        eng.store_pages(keys[2:], _pages(keys[2:]))
        eng.flush()
        events = eng.manager.take_events()
        assert KVEvent("removed", hashes[0], "CPU") in events
        assert KVEvent("stored", hashes[0], "SSD") in events
        assert KVEvent("stored", hashes[2], "CPU") in events


def test_blocks_reset_while_being_written_are_never_announced(tmp_path: Path) -> None:
    # reset_cache while a spill and a write-through store are still running: when their jobs
    # end, the blocks are gone (stale), so no router may hear they are stored.
    ns = _ns()
    mgr = CacheManager(_config(tmp_path, 2, 16), ns, PAGE_BYTES, free_target=0)
    keys = _keys(ns, 3)
    first = mgr.prepare_store(keys[:2], None)
    assert first is not None
    mgr.complete(JobResult(first.job_id, "store"))
    spilling = mgr.prepare_store(keys[2:], None)  # no free slot: keys[0] spills first
    assert spilling is not None and spilling.spill.keys == (keys[0],)
    mgr.take_events()
    mgr.reset()
    mgr.complete(JobResult(spilling.job_id, "store"))
    events = mgr.take_events()
    hashes = {ns.block_hash(k) for k in keys}
    stored = [ev for ev in events if ev.kind == "stored" and ev.block_hash in hashes]
    assert not stored, stored
    assert mgr.lookup(keys) == 0


def test_reset_forgets_host_and_ssd(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 32, admission="write_through")
    ns = _ns()
    keys = _keys(ns, 3)
    with _engine(cfg, ns, 4) as eng:
        assert eng.store_pages(keys, _pages(keys)).ok
        eng.reset()
        assert eng.lookup(keys) == 0 and eng.manager.index.free_slots == 4
        assert Tier.SSD in eng.executor.tiers
        assert not any(eng.executor.tiers[Tier.SSD].contains(k) for k in keys)
    with _engine(cfg, ns, 4) as eng:
        assert eng.lookup(keys) == 0


def test_manager_input_checks(tmp_path: Path) -> None:
    mgr = CacheManager(_config(tmp_path, 4), _ns(), PAGE_BYTES)
    with pytest.raises(ValueError, match="GPU block ids"):
        mgr.prepare_store(_keys(_ns(), 2), [1])
    with pytest.raises(ValueError, match="GPU block ids"):
        mgr.prepare_load(_keys(_ns(), 2), [1, 2, 3])
    assert mgr.prepare_load([], []) is None
