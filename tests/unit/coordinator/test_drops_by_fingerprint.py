"""Drops the scheduler names by fingerprint (it keeps no full keys of cold blocks,
flexkv_py/index/cold_blocks.py), resolved by each worker's real SSD store (its key table is
hashed by the same 8 bytes past the rank tag, rust/index/by_fingerprint.rs): every TP rank
resolves one drop to its own copy, a restart's adoption over capacity evicts by fingerprint, a
reset deletes the namespace on the worker, and the `removed` KV events name the deleted blocks
(one job after the decision). A fingerprint clash drops at most one more copy: that block is
recomputed, never served wrong."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages

from flexkv_py.coordinator import CacheEngine, DropJob, Drops, JobResult, store_job
from flexkv_py.coordinator.jobs import INTERNAL
from flexkv_py.coordinator.kv_events import KVEvent
from flexkv_py.coordinator.legs import Blocks
from flexkv_py.errors import FlexKVError
from flexkv_py.index.cold_blocks import key_print
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.ssd.tier import SsdTier


def _store_all(eng: CacheEngine, keys: list[bytes], step: int) -> None:
    """Store `keys` `step` at a time, then everything owed to the SSD."""
    for i in range(0, len(keys), step):
        assert eng.store_pages(keys[i : i + step], _pages(keys[i : i + step])).ok
    eng.flush()
    assert eng.flush_write_behind(30.0) == 0


def _removed_on_ssd(events: list[KVEvent]) -> set[bytes]:
    return {e.block_hash for e in events if e.kind == "removed" and e.medium == "SSD"}


def test_every_tp_rank_resolves_one_drop_to_its_own_copy(tmp_path: Path) -> None:
    ns = _ns(tp_size=2)
    cfg = _config(tmp_path, 4, 64, world=2)
    keys = _keys(ns, 12)
    ranks = [SsdTier(cfg, ns.for_rank(r)) for r in range(2)]
    try:
        for r, tier in enumerate(ranks):
            pages = _pages(keys, salt=bytes([r]))  # each rank's own shard of the blocks
            results = tier.submit_put(list(zip(keys, pages, strict=True))).wait(30)
            assert all(x.ok for x in results)
        victims = keys[2:5]
        joined = b"".join(key_print(k) for k in victims)
        per_rank = [
            JobResult(7, "drop", dropped={Tier.SSD: tuple(t.delete_fingerprints(joined))})
            for t in ranks
        ]
        for r, tier in enumerate(ranks):
            assert sorted(per_rank[r].dropped[Tier.SSD]) == sorted(victims)
            assert sorted(tier.keys()) == sorted(set(keys) - set(victims))
        merged = JobResult.merge(per_rank)
        assert sorted(merged.dropped[Tier.SSD]) == sorted(victims)  # each block once
        assert ranks[0].delete_fingerprints(joined) == []  # gone: nothing left to resolve
    finally:
        for tier in ranks:
            tier.close()


def test_a_restart_over_capacity_evicts_by_fingerprint_and_announces_it(tmp_path: Path) -> None:
    ns = _ns()
    keys = _keys(ns, 30)
    with _engine(_config(tmp_path, 4, 64), ns, 4, free_target=0) as eng:
        _store_all(eng, keys, 3)
        stored = set(eng.executor.tiers[Tier.SSD].keys())
    assert len(stored) == 30
    with _engine(_config(tmp_path, 4, 64), ns, 4, free_target=0) as eng:
        index = eng.manager.index
        assert set(index.cold_keys_among(keys)) == stored  # adopted, cold
        index.set_lower_capacity(Tier.SSD, 15)  # fewer blocks than adopted: evicts at once
        eng.flush()
        ssd = eng.executor.tiers[Tier.SSD]
        left = set(ssd.keys())
        assert len(left) == index.occupancy(Tier.SSD) == index.lower_capacity(Tier.SSD) == 15
        assert set(index.cold_keys_among(keys)) == left  # the index holds what the store does
        gone = stored - left
        removed = _removed_on_ssd(eng.manager.take_events())
        assert removed == {ns.block_hash(k) for k in gone}
        kept = [(k, p) for k, p in zip(keys, _pages(keys), strict=True) if k in left]
        assert [eng.load_pages([k]) for k, _ in kept] == [[p] for _, p in kept]


def test_a_reset_deletes_the_namespace_on_the_worker_and_announces_its_cold_blocks(
    tmp_path: Path,
) -> None:
    ns = _ns()
    keys = _keys(ns, 20)
    with _engine(_config(tmp_path, 4, 64), ns, 4, free_target=0) as eng:
        _store_all(eng, keys, 4)
        ssd = eng.executor.tiers[Tier.SSD]
        on_ssd = set(ssd.keys())
        cold = set(eng.manager.index.cold_keys_among(keys))
        assert cold and cold <= on_ssd
        eng.manager.take_events()
        eng.reset()
        assert ssd.keys() == []
        removed = _removed_on_ssd(eng.manager.take_events())
        # Every block the index held on the SSD is announced, cold ones from the worker's
        # namespace delete.
        assert removed == {ns.block_hash(k) for k in on_ssd}
        assert eng.lookup(keys) == 0
        assert eng.manager.stats()["inflight_jobs"] == 0


def test_a_fingerprint_clash_on_a_drop_loses_a_copy_never_serves_wrong_kv(tmp_path: Path) -> None:
    """A clash (two keys, one fingerprint) makes the worker delete a block the scheduler still
    holds. Forced here: the drop's fingerprints name a victim and a block the index keeps. The
    kept one is not announced removed, its load finds it missing (recomputed) and it leaves the
    index; the blocks around it load bit for bit."""
    ns = _ns()
    keys = _keys(ns, 8)
    pages = _pages(keys)
    with _engine(_config(tmp_path, 4, 64), ns, 4, free_target=0) as eng:
        _store_all(eng, keys, 4)
        index = eng.manager.index
        assert all(index.readable_on(k, Tier.SSD) for k in keys)
        eng.manager.take_events()
        cold = index.cold_keys_among(keys)
        assert len(cold) >= 3
        clashed = cold[1]  # only on the SSD: no host copy hides the loss
        job = DropJob(10_000, Drops(prints={Tier.SSD: key_print(clashed)}))
        eng.executor.submit(job)
        for result in eng.executor.wait([job.job_id]):
            assert result.dropped == {Tier.SSD: (clashed,)}
            eng.manager.complete(result)
        assert not _removed_on_ssd(eng.manager.take_events())  # still indexed: not announced
        assert index.readable_on(clashed, Tier.SSD)
        assert eng.lookup([clashed]) == 1  # still promised: the index does not know
        # Missing on the SSD: recomputed, never another block's bytes.
        assert eng.load_pages([clashed]) == [None]
        page = dict(zip(keys, pages, strict=True))
        for k in (cold[0], cold[2]):  # the blocks around it load bit for bit
            assert eng.load_pages([k]) == [page[k]]
        assert not index.readable_on(clashed, Tier.SSD)  # forgotten by the failed read
        assert eng.stats()["manager"]["ssd_read_not_found_blocks"] == 1


def test_a_job_that_crashes_after_its_drop_first_still_names_what_it_deleted(
    tmp_path: Path,
) -> None:
    """A job's `drop_first` deletes cold blocks by fingerprint before its body runs; a body
    that crashes (here a host-only fill raising) must still name them in its result, or their
    `removed` events are lost and the record of them is kept forever."""
    ns = _ns()
    keys = _keys(ns, 8)
    with _engine(_config(tmp_path, 4, 64), ns, 4, free_target=0) as eng:
        _store_all(eng, keys, 4)
        victim = eng.manager.index.cold_keys_among(keys)[0]

        def crash() -> None:
            raise RuntimeError("fill failed")

        job = store_job(
            20_000,
            Blocks((b"x" * 8,)),
            None,
            (0,),  # never written: the fill crashes first
            ((),),
            drop_first=Drops(prints={Tier.SSD: key_print(victim)}),
        )
        result = eng.executor.submit(job, crash).wait(30)
        assert result.failed == {b"x" * 8: INTERNAL}
        assert result.dropped == {Tier.SSD: (victim,)}
        assert victim not in eng.executor.tiers[Tier.SSD].keys()


def test_a_delete_the_store_refuses_neither_stops_the_job_nor_raises_to_its_submitter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `drop_first` runs in the thread that submits the job (a vLLM worker's step). An SSD
    whose journal refuses the deletes' records (EIO or a full device) raised out of `submit`:
    the job never ran and never completed (its blocks pinned, a load's request waiting), or
    the worker's step crashed. Now the refusal is counted and the job runs."""
    ns = _ns()
    keys = _keys(ns, 8)
    cfg = _config(tmp_path, 4, 64)
    with _engine(cfg, ns, 4, free_target=0) as eng:
        _store_all(eng, keys, 4)
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "journal:EIO:1")  # every journal write fails
    eng = _engine(cfg, ns, 4, free_target=0)
    try:
        victim = eng.manager.index.cold_keys_among(keys)[0]  # adopted at the restart
        job = store_job(
            20_001,
            Blocks((b"y" * 8,)),
            None,
            (0,),  # already filled (nothing to copy), written to no tier
            ((),),
            drop_first=Drops.of({Tier.SSD: (keys[1],)}, {Tier.SSD: key_print(victim)}),
        )
        result = eng.executor.submit(job).wait(30)
        assert result.ok and result.dropped == {}
        assert eng.executor.stats()["ssd_delete_errors"] == 2
    finally:
        with contextlib.suppress(FlexKVError):  # nor can its clean-shutdown record be written
            eng.close()
