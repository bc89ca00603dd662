"""Prefix-aware host eviction (index/index_core.py): a block whose chain child is cached never
leaves first, so a long prefix keeps what fits and a shared system prompt survives its suffixes.
Manager-level (no bytes move): the store jobs' results are applied as the workers would."""

from __future__ import annotations

from pathlib import Path

from helpers.coordinator_util import PAGE_BYTES, _config, _keys, _ns

from flexkv_py.coordinator import CacheManager, JobResult
from flexkv_py.coordinator.engine import pipeline_parts


def _manager(tmp_path: Path, slots: int) -> CacheManager:
    return CacheManager(_config(tmp_path, slots), _ns(), PAGE_BYTES, num_host_slots=slots)


def _store(mgr: CacheManager, keys: list[bytes], *, chain: bool = True) -> None:
    """Store one request's keys in the engine's parts (each part's parent: the block before)."""
    for start, end in pipeline_parts(len(keys)):
        parents = [keys[i - 1] if i and chain else None for i in range(start, end)]
        job = mgr.prepare_store(keys[start:end], None, parents=parents)
        if job is not None:
            mgr.complete(JobResult(job.job_id, "store"))


def test_a_chain_larger_than_the_host_tier_keeps_its_head(tmp_path: Path) -> None:
    n, slots = 8192, 7782  # the host tier holds 95 % of the chain
    mgr = _manager(tmp_path, slots)
    keys = _keys(mgr.namespace, n)
    _store(mgr, keys)
    assert mgr.lookup(keys) >= 0.9 * slots
    # The same blocks without chain links: LRU evicts the head, nothing matches.
    plain = _manager(tmp_path, slots)
    _store(plain, keys, chain=False)
    assert plain.lookup(keys) == 0


def test_a_shared_system_prompt_outlives_its_suffixes(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, 256)
    ns = mgr.namespace
    prompt = _keys(ns, 32, "system")
    for r in range(100):  # 100 requests x 32 suffix blocks: 12x the host tier
        keys = prompt + _keys(ns, 32, f"r{r}-")
        _store(mgr, keys)
        assert mgr.lookup(keys[:32]) == 32, r
    last = prompt + _keys(ns, 32, "r99-")
    assert mgr.lookup(last) == 64  # the newest request matches whole
    assert mgr.stats()["index_host_ready"] <= 256
