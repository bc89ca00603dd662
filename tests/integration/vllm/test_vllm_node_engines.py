"""Several engines on one node and one stored copy of MLA KV at TP > 1
(item 10), through vLLM's real Scheduler (helpers/vllm_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from flexkv_py.config import load_config
from flexkv_py.index.lower_capacity import STORE_PAGE, SUPERBLOCK_PAGES, block_pages
from flexkv_py.index.tier_names import Tier
from flexkv_py.integration.vllm.placement import engine_placement
from flexkv_py.tiers.node.shards import SiblingShards
from integration.vllm.test_vllm_connector import block_bits, engine, loaded, prompt_done

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16


def side_manager(e: vh.Engine) -> Any:
    """The scheduler side's CacheManager."""
    (side,) = e.flexkv_scheduler_sides()
    return side._mgr


def side_stats(e: vh.Engine) -> dict[str, Any]:
    return dict(side_manager(e).stats())


def worker_stats(e: vh.Engine, rank: int = 0) -> dict[str, Any]:
    return dict(e.workers[rank].connector.worker_side._executor.stats())


def shards(ssd: Path) -> list[str]:
    return sorted(p.name for p in ssd.iterdir() if p.is_dir())


def hit_and_compare(e: vh.Engine, req_id: str, prompt: list[int], bits: list[Any], n: int) -> None:
    e.reset_gpu_prefix_cache()
    before = len(e.history)
    req = e.add(vh.make_request(req_id, prompt, max_tokens=2))
    e.run_until(prompt_done(req))
    assert loaded(e, req_id), f"{req_id} got nothing from the connector"
    assert not any(rec.invalid_block_ids for rec in e.history[before:]), "a load failed"
    for rank in range(len(e.workers)):
        got = block_bits(e, req_id, n, rank=rank)
        assert all(torch.equal(x, y) for x, y in zip(bits[rank], got, strict=True))
    e.run()
    assert not e.mismatches()


# ------------------------------------------------------------------------ item 9: engines per node
def test_two_engines_side_by_side_on_one_ssd_dir(model_dir: str, tmp_path: Path) -> None:
    """Engine B starts while A holds its shard: no StoreLockedError (its own shard, named by
    instance_id), the node's sizes are split between them (instance_num), and B hits the
    blocks A stored, read from A's shard."""
    ssd = tmp_path / "ssd"
    node = vh.with_ssd(ssd, instance_num=2)
    alone = engine(model_dir, vh.with_ssd(tmp_path / "alone"))
    slots_alone = side_stats(alone)["host_slots"]
    alone.shutdown()

    a = engine(model_dir, {**node, "instance_id": 0})
    assert side_stats(a)["host_slots"] == slots_alone // 2  # per node, over 2 engines
    prompt = vh.prompt_tokens(91, 4 * BS)
    req = a.add(vh.make_request("A", prompt, max_tokens=2))
    a.run_until(prompt_done(req))
    bits = [block_bits(a, "A", 4)]
    a.run()

    b = engine(model_dir, {**node, "instance_id": 1})  # A still runs
    assert worker_stats(b)["ssd_unavailable"] == 0
    assert shards(ssd) == ["engine0-tp0-pp0", "engine1-tp0-pp0"]
    assert side_stats(b)["node_adopted_blocks"] == 4  # A's, from its shard
    assert side_stats(b).get("ssd_adopted_blocks", 0) == 0  # not B's own SSD capacity
    assert worker_stats(b)["node"]["sibling_shards"] == 1
    hit_and_compare(b, "B", prompt, bits, 4)
    assert worker_stats(b)["ssd"]["blocks"] == 0, "B wrote a copy of A's blocks"
    vh.assert_no_leaks(b)
    b.shutdown()
    a.shutdown()


def test_b_follows_what_a_stores_and_evicts_after_b_started(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sibling shards are kept up to date (SiblingShards' refresh): B hits a prefix A stored
    after B started, bit-identical; blocks A evicts stop being offered by B (a prompt of them is
    computed, never read); and A's blocks never count against B's own SSD capacity."""
    monkeypatch.setattr(SiblingShards, "refresh_s", 0.1)
    probe = engine(model_dir, vh.with_ssd(tmp_path / "probe"))
    slot = probe.workers[0].connector.worker_side._executor.pool.slot_nbytes
    probe.shutdown()
    # Each engine's SSD holds 8 blocks, its host tier 6 (the node's sizes over 2 engines).
    ssd_bytes = (8 * block_pages(slot) + SUPERBLOCK_PAGES) * STORE_PAGE
    sizes = {"ssd_cache_gb": 2 * ssd_bytes / (1 << 30), "cpu_cache_gb": 2 * 6 * slot / (1 << 30)}
    node = vh.with_ssd(tmp_path / "ssd", instance_num=2, **sizes)
    a = engine(model_dir, {**node, "instance_id": 0})
    b = engine(model_dir, {**node, "instance_id": 1})  # before A stored anything
    assert side_stats(b).get("node_adopted_blocks", 0) == 0

    def compute(e: vh.Engine, req_id: str, prompt: list[int], n: int) -> list[Any]:
        req = e.add(vh.make_request(req_id, prompt, max_tokens=2))
        e.run_until(prompt_done(req))
        bits = block_bits(e, req_id, n)
        e.run()
        return bits

    def b_sees(stat: str, n: int) -> None:
        b.run_until(lambda: side_stats(b).get(stat, 0) >= n, timeout_s=30)

    p, r, big = (vh.prompt_tokens(s, n * BS) for s, n in ((95, 4), (96, 4), (97, 16)))
    bits = [compute(a, "A1", p, 4)]
    b_sees("node_adopted_blocks", 4)
    hit_and_compare(b, "B1", p, bits, 4)
    assert worker_stats(b)["node_read_blocks"] == 4
    compute(a, "A2", r, 4)  # A's SSD is full now: 8 blocks
    b_sees("node_adopted_blocks", 8)
    stats = side_stats(b)
    assert stats["index_on_node"] == 8 and stats["index_on_ssd"] <= 4  # B's own: only P's
    a_ssd = a.workers[0].connector.worker_side._executor.tiers[Tier.SSD]
    b_node = b.workers[0].connector.worker_side._executor.tiers[Tier.NODE]

    def b_tracks_a() -> bool:
        # The scheduler's own set, not its count: B's worker refreshes its sibling shard in the
        # background and reports the change on a later step, so right after a refresh that
        # evicted 4 and added 4 the scheduler's count already matches while its keys do not.
        held = set(a_ssd.keys())
        offered = side_manager(b).index
        return (
            set(b_node.keys()) == held
            and side_stats(b)["index_on_node"] == len(held)
            and all(offered.readable_on(k, Tier.NODE) for k in held)
        )

    before = set(a_ssd.keys())
    compute(a, "A3", big, 16)  # A's full SSD evicts blocks for big's
    assert side_stats(a)["ssd_evicted_blocks"] >= 1
    # The index decides an eviction at once; A's store deletes it in a later job: wait for
    # that, or B could "track" A's store before it changed.
    a.run_until(lambda: not before <= set(a_ssd.keys()), timeout_s=30)
    b.run_until(b_tracks_a, timeout_s=30)
    # B stopped offering A's evicted blocks: forgotten when A's removals reached the scheduler,
    # or already evicted by the node tier's own capacity when A's new blocks were reported
    # first (A's journal can show a put before the drop that made room for it).
    stats = side_stats(b)
    assert stats.get("node_forgotten_blocks", 0) + stats.get("node_evicted_blocks", 0) >= 1, stats
    # A drops every block (as a weight update would): B stops offering all of them.
    assert a.scheduler.reset_prefix_cache(reset_connector=True)
    a.run_until(lambda: not a_ssd.keys(), timeout_s=30)
    b.run_until(b_tracks_a, timeout_s=30)
    assert side_stats(b)["index_on_node"] == 0
    b.reset_gpu_prefix_cache()
    before = len(b.history)
    req = b.add(vh.make_request("B2", r, max_tokens=2))
    b.run_until(prompt_done(req))
    b.run()
    assert not loaded(b, "B2"), "B offered blocks its sibling evicted"
    assert not any(rec.invalid_block_ids for rec in b.history[before:])
    assert not b.mismatches() and not a.mismatches()
    vh.assert_no_leaks(b)
    b.shutdown()
    a.shutdown()


def test_a_sibling_shard_is_not_read_when_sharing_is_off(model_dir: str, tmp_path: Path) -> None:
    node = vh.with_ssd(tmp_path / "ssd", instance_num=2)
    a = engine(model_dir, {**node, "instance_id": 0})
    a.add(vh.make_request("A", vh.prompt_tokens(92, 4 * BS), max_tokens=2))
    a.run()
    b = engine(model_dir, {**node, "instance_id": 1, "share_node_shards": False})
    assert side_stats(b).get("ssd_adopted_blocks", 0) == 0
    assert side_stats(b).get("node_adopted_blocks", 0) == 0
    b.shutdown()
    a.shutdown()


def test_data_parallel_ranks_get_their_own_shards_and_node_sizes(model_dir: str) -> None:
    """vLLM's data-parallel rank names the shard; cache_size_scope=node divides the sizes by
    the data-parallel ranks on this node; instance_num / instance_id take precedence."""
    cfg = vh.make_vllm_config(model_dir, None)
    spec = vh.make_kv_cache_config(cfg, 16).kv_cache_groups[0].kv_cache_spec
    p = cfg.parallel_config
    assert engine_placement(cfg, load_config(env={}), spec).engine_id is None
    p.data_parallel_size, p.data_parallel_rank, p.data_parallel_size_local = 8, 5, 4
    place = engine_placement(cfg, load_config(env={}), spec)
    assert (place.engine_id, place.node_engines, place.kv_replicated) == (5, 1, False)
    place = engine_placement(cfg, load_config({"cache_size_scope": "node"}, env={}), spec)
    assert (place.engine_id, place.node_engines) == (5, 4)
    place = engine_placement(cfg, load_config({"instance_num": 3, "instance_id": 2}, env={}), spec)
    assert (place.engine_id, place.node_engines) == (2, 3)


# ------------------------------------------------------------------------ item 10: MLA at TP > 1
@pytest.fixture
def mla_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The harness's model with DeepSeek-style MLA caches: one latent (head 1) per layer, the
    same on every TP rank (vLLM's MLAAttentionSpec, [B, 1, N, C] tensors)."""

    def mla_spec(**kw: Any) -> MLAAttentionSpec:
        return MLAAttentionSpec(**{**kw, "num_kv_heads": 1, "head_size": 2 * vh.HEAD_SIZE})

    monkeypatch.setattr(vh, "FullAttentionSpec", mla_spec)
    yield


def mla_engine(model_dir: str, extra: dict[str, Any]) -> vh.Engine:
    e = engine(model_dir, extra, tp_size=2)
    for w in e.workers:
        w.model.rank = 0  # the latent KV is the same on every rank
    return e


@pytest.mark.usefixtures("mla_cache")
def test_mla_at_tp2_stores_one_copy_every_rank_reads(model_dir: str, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    extra = vh.with_ssd(ssd)
    prompt = vh.prompt_tokens(93, 4 * BS)
    e1 = mla_engine(model_dir, extra)
    req = e1.add(vh.make_request("A", prompt, max_tokens=2))
    e1.run_until(prompt_done(req))
    bits = [block_bits(e1, "A", 4, rank=r) for r in (0, 1)]
    assert all(torch.equal(x, y) for x, y in zip(*bits, strict=True))
    e1.run()
    assert shards(ssd) == ["tp0-pp0"], "rank 1 made a shard of its own"
    assert worker_stats(e1, 0)["ssd"]["blocks"] == 4
    # The one shard gets the whole SSD budget (not the half a rank's shard gets).
    ssd_tier = e1.workers[0].connector.worker_side._executor.tiers[Tier.SSD]
    assert ssd_tier.capacity_bytes == int(extra["ssd_cache_gb"] * (1 << 30))
    assert worker_stats(e1, 1)["ssd"] == {"replica_of": "tp0-pp0"}
    assert side_stats(e1)["ssd_written_blocks"] == 4  # both ranks' results counted
    e1.shutdown()

    e2 = mla_engine(model_dir, extra)  # restart: both ranks report rank 0's shard
    assert side_stats(e2)["ssd_adopted_blocks"] == 4
    hit_and_compare(e2, "B", prompt, bits, 4)  # host empty: every rank reads rank 0's copy
    assert worker_stats(e2, 1)["ssd_read_blocks"] == 4
    assert shards(ssd) == ["tp0-pp0"]
    vh.assert_no_leaks(e2)
    e2.shutdown()


@pytest.mark.usefixtures("mla_cache")
def test_mla_rank1_reads_blocks_stored_after_it_opened(model_dir: str, tmp_path: Path) -> None:
    """Rank 1's view of rank 0's shard is a snapshot: a block stored since is found by
    reading again from a fresh one (here: a host tier too small to keep the blocks)."""
    extra = vh.with_ssd(tmp_path / "ssd", cpu_cache_gb=3 * 4096 / (1 << 30))
    e = mla_engine(model_dir, extra)
    prompt = vh.prompt_tokens(94, 6 * BS)
    req = e.add(vh.make_request("A", prompt, max_tokens=2))
    e.run_until(prompt_done(req))
    bits = [block_bits(e, "A", 6, rank=r) for r in (0, 1)]
    e.run()
    hit_and_compare(e, "B", prompt, bits, 6)
    assert worker_stats(e, 1)["ssd_read_blocks"] >= 3
    vh.assert_no_leaks(e)
    e.shutdown()
