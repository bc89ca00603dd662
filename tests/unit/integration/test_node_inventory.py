"""The scheduler's view of sibling engines' SSD blocks (integration/vllm/node_inventory.py) on a
real CacheManager: a key is offered once every worker reported it, stops being offered when one
reports it gone, and such blocks never count against this engine's own SSD capacity."""

from __future__ import annotations

from pathlib import Path

from helpers.coordinator_util import PAGE_BYTES, _config, _keys, _ns

from flexkv_py.coordinator import CacheManager
from flexkv_py.integration.vllm.node_inventory import NodeInventory


def test_offered_once_every_rank_reported_and_forgotten_when_one_lost_it(
    tmp_path: Path,
) -> None:
    ns = _ns()
    mgr = CacheManager(_config(tmp_path, 2, 16), ns, PAGE_BYTES, free_target=0)
    k1, k2, k3 = _keys(ns, 3)
    node = NodeInventory(num_workers=2)
    assert node.apply(mgr, {(0, 0): (k1, k2)}, {}) == (0, 0)
    assert mgr.lookup([k1]) == 0  # rank (1, 0) has not seen it: its load would fail there
    assert node.apply(mgr, {(1, 0): (k1,)}, {}) == (1, 0)
    assert mgr.lookup([k1]) == 1 and mgr.lookup([k2]) == 0
    # Gone on one rank before the other reported it: never offered.
    assert node.apply(mgr, {(1, 0): (k3,)}, {(0, 0): (k2,)}) == (0, 0)
    assert node.apply(mgr, {(0, 0): (k3,)}, {}) == (1, 0)
    assert node.apply(mgr, {(1, 0): (k2,)}, {}) == (0, 0)  # k2's (0, 0) report was withdrawn
    assert node.apply(mgr, {}, {(1, 0): (k1,)}) == (0, 1)
    assert mgr.lookup([k1]) == 0 and mgr.lookup([k3]) == 1


def test_sibling_blocks_do_not_count_against_the_own_ssd(tmp_path: Path) -> None:
    ns = _ns()
    mgr = CacheManager(_config(tmp_path, 2, 16), ns, PAGE_BYTES, free_target=0)
    keys = _keys(ns, 40)  # far more than the own SSD's 16 blocks
    assert NodeInventory(num_workers=1).apply(mgr, {(0, 0): tuple(keys)}, {}) == (40, 0)
    assert mgr.lookup(keys) == 40
    stats = mgr.stats()
    assert stats["index_on_node"] == 40 and stats["index_on_ssd"] == 0
    assert stats.get("ssd_evicted_blocks", 0) == 0 and not mgr.take_jobs()
