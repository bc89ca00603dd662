"""SSD evictions decided by the index (index_core.py `_make_room`): within the store's capacity
as the store lays blocks out, tail-first along chains (also across a restart, with parents),
the deletes sent before the write that needs the room, and never a lookup that promises a block
the store no longer holds. Manager-level tests apply the jobs' results as the workers would;
engine-level ones drive a real SSD tier on tmp_path."""

from __future__ import annotations

from pathlib import Path

from helpers.coordinator_util import PAGE_BYTES, _config, _engine, _keys, _ns, _pages

from flexkv_py.coordinator import CacheManager, DropJob, JobResult, SpillJob, StoreJob
from flexkv_py.coordinator.manager import ssd_capacity_blocks
from flexkv_py.index.cold_blocks import key_print
from flexkv_py.index.lower_capacity import STORE_PAGE, block_pages, store_capacity_blocks
from flexkv_py.index.tier_names import Tier


def _manager(tmp_path: Path, host: int, ssd: int) -> CacheManager:
    return CacheManager(_config(tmp_path, host, ssd), _ns(), PAGE_BYTES, num_host_slots=host)


def _resolved(keys: tuple[bytes, ...], prints: bytes, universe: list[bytes]) -> list[bytes]:
    """The deletes a job carries as a worker resolves them: its keys, and the blocks of
    `universe` (every key the test stored) that its fingerprints name."""
    named = {prints[i : i + 8] for i in range(0, len(prints), 8)}
    assert all(len(p) == 8 for p in named)
    by_print = {key_print(k): k for k in universe}
    assert named <= set(by_print), "a fingerprint names no block the test stored"
    return [*keys, *(by_print[p] for p in named)]


def _drops_of(job: object, universe: list[bytes]) -> list[bytes]:
    drops = job.drops if isinstance(job, DropJob) else job.drop_first  # type: ignore[attr-defined]
    return _resolved(drops.keys_on(Tier.SSD), drops.prints_on(Tier.SSD), universe)


def _drain(mgr: CacheManager, drops: list[bytes], universe: list[bytes]) -> None:
    """Complete every background job as a worker would; collect the deletes they carry."""
    while jobs := mgr.take_jobs():
        for job in jobs:
            drops += _drops_of(job, universe)
            mgr.complete(JobResult(job.job_id, job.kind))


def _store(mgr: CacheManager, keys: list[bytes], drops: list[bytes]) -> None:
    """Store one request (a chain) block by block, as a long prefill's steps would."""
    for i, key in enumerate(keys):
        job = mgr.prepare_store([key], None, parents=[keys[i - 1] if i else None])
        if job is not None:
            drops += _drops_of(job, keys)
            mgr.complete(JobResult(job.job_id, "store"))
        _drain(mgr, drops, keys)


def test_capacity_is_the_stores_layout() -> None:
    # One header page + data rounded up to pages; page 0 of each directory is the superblock.
    assert block_pages(1) == 2 and block_pages(STORE_PAGE) == 2 and block_pages(STORE_PAGE + 1) == 3
    assert store_capacity_blocks(10 * 2 * STORE_PAGE, 1, STORE_PAGE) == 9
    assert store_capacity_blocks(10 * 2 * STORE_PAGE + STORE_PAGE, 1, STORE_PAGE) == 10
    assert store_capacity_blocks(2 * (5 * 2 + 1) * STORE_PAGE, 2, STORE_PAGE) == 10


def test_a_chain_larger_than_the_ssd_keeps_its_head(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, 8, 64)
    cap = mgr.index.lower_capacity(Tier.SSD)
    assert cap == ssd_capacity_blocks(mgr.config, mgr.namespace, PAGE_BYTES) == 63
    keys = _keys(mgr.namespace, 200)
    drops: list[bytes] = []
    _store(mgr, keys, drops)
    assert mgr.index.occupancy(Tier.SSD) <= cap
    # Tail-first: the chain's head stays matchable (LRU would keep only its newest blocks).
    hit = mgr.index.readable_prefix(keys)
    assert hit >= 0.9 * cap
    stats = mgr.stats()
    # Every eviction was the index's and its delete went out in a job; none hit the head.
    assert stats.get("ssd_index_evicted_blocks", 0) == len(drops) == len(set(drops))
    assert not set(drops) & set(keys[:hit])
    assert stats.get("ssd_store_evicted_blocks", 0) == 0
    # The blocks past what fits were never written: their chain was cut above them.
    assert not any(mgr.index.readable_on(k, Tier.SSD) for k in keys[hit:])


def test_deletes_travel_with_the_write_that_needs_the_room(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, 2, 4)  # 3 SSD blocks
    keys = _keys(mgr.namespace, 12, "x")
    for key in keys:  # unrelated blocks (no chain): every spill past 3 evicts one
        job = mgr.prepare_store([key], None)
        assert job is not None
        mgr.complete(JobResult(job.job_id, "store"))
        for j in mgr.take_jobs():
            if isinstance(j, (SpillJob, StoreJob)) and j.drop_first:
                # The victims are gone from the index before the job is handed out.
                victims = _drops_of(j, keys)
                assert victims and not any(mgr.index.readable_on(k, Tier.SSD) for k in victims)
            mgr.complete(JobResult(j.job_id, j.kind))
        assert mgr.index.occupancy(Tier.SSD) <= 3


def _adopt(tmp_path: Path, parents: bool) -> tuple[CacheManager, list[bytes], list[bytes]]:
    mgr = _manager(tmp_path, 4, 64)  # 63 SSD blocks
    keys = _keys(mgr.namespace, 100)
    links = {keys[i]: keys[i - 1] for i in range(1, 100)} if parents else None
    # Head first, as a store's LRU lists a chain it wrote in order: plain LRU evicts the head.
    assert mgr.adopt_ssd_keys([keys], parents=links) == 100
    drops: list[bytes] = []
    _drain(mgr, drops, keys)
    return mgr, keys, drops


def test_adopted_chains_with_parents_evict_from_the_tail(tmp_path: Path) -> None:
    mgr, keys, drops = _adopt(tmp_path, parents=True)
    assert mgr.index.readable_prefix(keys) == 63
    assert sorted(drops) == sorted(keys[63:])
    assert mgr.index.kids(keys[0]) == 1 and mgr.index.kids(keys[62]) == 0


def test_adopted_blocks_without_parents_evict_in_store_order(tmp_path: Path) -> None:
    mgr, keys, drops = _adopt(tmp_path, parents=False)
    assert mgr.index.readable_prefix(keys) == 0  # no parents: the oldest (the head) went first
    assert sorted(drops) == sorted(keys[:37])


def test_no_lookup_promises_a_block_the_store_lost(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 16)
    ns = _ns()
    chains = [_keys(ns, 9, f"c{c}-") for c in range(6)]
    with _engine(cfg, ns, 4, free_target=0) as eng:
        ssd = eng.executor.tiers[Tier.SSD]
        for rnd in range(3):
            for c, keys in enumerate(chains):
                pages = _pages(keys)
                n = eng.lookup(keys)
                got = eng.load_pages(keys[:n])
                assert got == pages[:n]  # every promised block loads, bit for bit
                assert eng.store_pages(keys, pages).ok
                eng.flush()
                on_ssd = set(ssd.keys())
                # Every key the index may hold (cold keys are fingerprints, not listable).
                for k in [k for keys in chains for k in keys]:
                    if eng.manager.index.readable_on(k, Tier.SSD):
                        assert k in on_ssd, (rnd, c)
        stats = eng.stats()["manager"]
        assert stats["ssd_index_evicted_blocks"] > 0
        assert stats.get("ssd_store_evicted_blocks", 0) == 0
        assert stats.get("load_failed_blocks", 0) == 0


def test_the_stores_own_eviction_is_a_counted_safety_net(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 16)
    ns = _ns()
    keys = _keys(ns, 40)
    with _engine(cfg, ns, 4, free_target=0) as eng:
        eng.manager.index.set_lower_capacity(Tier.SSD, None)  # sizes wrong: the store decides
        for i in range(0, 40, 4):
            assert eng.store_pages(keys[i : i + 4], _pages(keys[i : i + 4])).ok
            eng.flush()
        stats = eng.stats()["manager"]
        assert stats["ssd_store_evicted_blocks"] > 0
        on_ssd = set(eng.executor.tiers[Tier.SSD].keys())
        promised = [k for k in keys if eng.manager.index.readable_on(k, Tier.SSD)]
        assert promised and set(promised) <= on_ssd  # reported, so the index forgot them
