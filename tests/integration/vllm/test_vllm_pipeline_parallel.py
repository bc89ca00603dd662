"""Pipeline parallel: every (TP, PP) worker stores and loads its own stage's layers, and a restart
adopts the SSD inventory of every stage (vLLM's scheduler, several worker-role connectors in one
process: see vllm_harness's `pp_size`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from flexkv_py import BlockStore
from flexkv_py.cli.inspect import DATA_FILE
from flexkv_py.coordinator import manager as manager_module
from flexkv_py.index import Tier
from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.namespace import SHARD_TAG
from flexkv_py.integration.vllm.pipeline_stages import (
    UnevenPipelineStagesError,
    stage_layer_counts,
)

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16
SHAPES = [pytest.param(1, 2, id="pp2"), pytest.param(2, 2, id="tp2xpp2")]


def engine(model_dir: str, extra: dict[str, Any], tp: int, pp: int) -> vh.Engine:
    return vh.Engine(
        model_dir, vh.connector_transfer_config(extra), tp_size=tp, pp_size=pp, num_blocks=64
    )


def prompt_done(req: Any) -> Any:
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def all_bits(e: vh.Engine, req_id: str, nblocks: int) -> list[list[torch.Tensor]]:
    """Per worker: its own layers' bytes of the request's first blocks."""
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0][:nblocks]
    return [[t for b in ids for t in w.model.block_bits(b)] for w in e.workers]


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(
        torch.equal(x, y) for wa, wb in zip(a, b, strict=True) for x, y in zip(wa, wb, strict=True)
    )


def loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def test_harness_builds_stages_as_vllm_numbers_them(model_dir: str, tmp_path: Path) -> None:
    e = engine(model_dir, vh.with_ssd(tmp_path / "ssd"), 2, 2)
    ranks = [(w.connector.worker_side.tp_rank, w.connector.worker_side.pp_rank) for w in e.workers]
    assert ranks == [(0, 0), (1, 0), (0, 1), (1, 1)]  # rank = pp * tp_size + tp
    # Each stage registers only its own layers; the scheduler sees stage 0's config.
    assert [sorted(w.kv_caches) for w in e.workers] == [
        [vh.LAYER_NAMES[0]],
        [vh.LAYER_NAMES[0]],
        [vh.LAYER_NAMES[1]],
        [vh.LAYER_NAMES[1]],
    ]
    assert e.kv_cache_config.kv_cache_groups[0].layer_names == [vh.LAYER_NAMES[0]]
    e.shutdown()


@pytest.mark.parametrize(("tp", "pp"), SHAPES)
def test_store_then_external_hit_is_bit_exact(
    model_dir: str, tmp_path: Path, tp: int, pp: int
) -> None:
    e = engine(model_dir, vh.with_ssd(tmp_path / "ssd"), tp, pp)
    prompt = vh.prompt_tokens(90 + tp, 4 * BS)
    a = e.add(vh.make_request("A", prompt, max_tokens=3))
    e.run_until(prompt_done(a))
    bits_a = all_bits(e, "A", 4)
    e.run()
    e.reset_gpu_prefix_cache()

    b = e.add(vh.make_request("B", prompt, max_tokens=3))
    e.run_until(prompt_done(b))
    assert loaded(e, "B")
    assert same(bits_a, all_bits(e, "B", 4))
    e.run()
    assert not e.mismatches()
    # Every worker of every stage recomputed only the last prompt token and the decodes.
    assert [w.model.written["B"] for w in e.workers] == [3] * (tp * pp)
    assert e.outputs["B"] == e.outputs["A"]
    dirs = sorted(p.name for p in (tmp_path / "ssd").iterdir() if p.is_dir())
    assert dirs == sorted(f"tp{t}-pp{p}" for t in range(tp) for p in range(pp))
    vh.assert_no_leaks(e)
    e.shutdown()


@pytest.mark.parametrize(("tp", "pp"), SHAPES)
def test_restart_with_same_ssd_dir_hits_on_every_stage(
    model_dir: str, tmp_path: Path, tp: int, pp: int
) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(95 + tp, 4 * BS)
    e1 = engine(model_dir, extra, tp, pp)
    a = e1.add(vh.make_request("A", prompt, max_tokens=3))
    e1.run_until(prompt_done(a))
    bits_a = all_bits(e1, "A", 4)
    e1.run()
    outputs_a = e1.outputs["A"]
    e1.shutdown()

    e2 = engine(model_dir, extra, tp, pp)  # new connectors, scheduler and KV tensors
    b = e2.add(vh.make_request("B", prompt, max_tokens=3))
    e2.run_until(prompt_done(b))
    assert loaded(e2, "B"), "no hit after restart"
    assert same(bits_a, all_bits(e2, "B", 4))
    e2.run()
    assert not e2.mismatches()
    assert [w.model.written["B"] for w in e2.workers] == [3] * (tp * pp)
    assert e2.outputs["B"] == outputs_a
    vh.assert_no_leaks(e2)
    e2.shutdown()


@pytest.mark.parametrize("lost_stage", ["first", "last"])
@pytest.mark.parametrize(("tp", "pp"), SHAPES)
def test_restart_adopts_only_blocks_every_stage_still_holds(
    model_dir: str, tmp_path: Path, tp: int, pp: int, lost_stage: str
) -> None:
    """A block is a hit only when every worker of every stage has its shard: one worker's SSD
    contents are gone, so nothing is adopted (not loaded, then failed on that worker)."""
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(97 + tp, 4 * BS)
    e1 = engine(model_dir, extra, tp, pp)
    e1.add(vh.make_request("A", prompt, max_tokens=3))
    e1.run()
    outputs_a = e1.outputs["A"]
    e1.shutdown()
    lost = tmp_path / "ssd" / (f"tp{tp - 1}-pp0" if lost_stage == "first" else f"tp0-pp{pp - 1}")
    shutil.rmtree(lost)

    e2 = engine(model_dir, extra, tp, pp)
    e2.add(vh.make_request("B", prompt, max_tokens=3))
    e2.run()
    assert not loaded(e2, "B")
    assert not any(rec.invalid_block_ids for rec in e2.history), "a stage failed its load"
    assert not e2.mismatches()
    assert [w.model.written["B"] for w in e2.workers] == [4 * BS + 2] * (tp * pp)
    assert e2.outputs["B"] == outputs_a
    vh.assert_no_leaks(e2)
    e2.shutdown()


def shard_keys(shard: Path) -> list[bytes]:
    """The logical keys a shard holds, oldest first (its storage keys past the rank tag)."""
    with BlockStore([str(shard)], 0, read_only=True) as view:
        return [k[SHARD_TAG.size :] for k in view.keys()]


@pytest.mark.parametrize(("tp", "pp"), SHAPES)
def test_restart_adopts_what_every_shard_holds_and_drops_the_orphans(
    model_dir: str, tmp_path: Path, tp: int, pp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last worker's shard lost one block of four: the restart adopts the three every
    shard holds, keeps no key of the lost one, and deletes it from the shards still holding
    it. Every worker reports joined keys and the scheduler intersects the buffers."""
    ssd = tmp_path / "ssd"
    extra = vh.with_ssd(ssd)
    e1 = engine(model_dir, extra, tp, pp)
    e1.add(vh.make_request("A", vh.prompt_tokens(99 + tp, 4 * BS), max_tokens=3))
    e1.run()
    e1.shutdown()
    shards = [ssd / f"tp{t}-pp{p}" for p in range(pp) for t in range(tp)]  # workers' order
    stored = shard_keys(shards[0])
    assert len(stored) == 4 and all(shard_keys(s) == stored for s in shards)
    lost = stored[2]
    size = (shards[-1] / DATA_FILE).stat().st_size  # the same size: the file is not resized
    with BlockStore([str(shards[-1])], size) as store:
        assert store.delete(SHARD_TAG.pack(tp - 1, pp - 1) + lost)
    intersected: list[tuple[Any, ...]] = []
    real = manager_module.common_and_orphans

    def recording(first: Any, others: Any) -> Any:
        got = real(first, others)
        intersected.append((first, *others, *got))
        return got

    monkeypatch.setattr(manager_module, "common_and_orphans", recording)

    e2 = engine(model_dir, extra, tp, pp)  # steps until the reports are adopted
    (side,) = e2.flexkv_scheduler_sides()
    common = [k for k in stored if k != lost]
    stats = side._mgr.stats()
    assert side._inventory.adopted_early == 3  # the scheduler's own read: the same three
    assert stats["ssd_adopted_blocks"] == 3 and stats["ssd_forgotten_blocks"] == 0
    assert [side._mgr.index.readable_on(k, Tier.SSD) for k in stored] == [1, 1, 0, 1]
    ((first, *rest, got_common, orphans),) = intersected
    assert len(rest) == tp * pp - 1
    assert all(isinstance(ks, JoinedKeys) for ks in (first, *rest, got_common, orphans))
    assert got_common == common and orphans == [lost]
    # The orphan's delete goes to the workers with a step's metadata.
    holders = e2.workers[:-1]
    e2.run_until(
        lambda: all(lost not in w.connector.worker_side.executor.stored_keys() for w in holders)
    )
    e2.shutdown()
    assert [shard_keys(s) for s in shards] == [common] * (tp * pp)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_uneven_layer_split_is_refused_at_start(tmp_path: Path, role: KVConnectorRole) -> None:
    """3 layers over PP=2 (vLLM splits them 2/1): the stages' pages differ, so the scheduler's
    slot plan and key namespace (from stage 0's page) would not fit stage 1."""
    d = tmp_path / "three-layers"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**vh.TINY_CONFIG, "num_hidden_layers": 3}))
    transfer = vh.connector_transfer_config(vh.with_ssd(tmp_path / "s"))
    cfg = vh.make_vllm_config(str(d), transfer, pp_size=2)
    assert stage_layer_counts(cfg) == [2, 1]
    with pytest.raises(UnevenPipelineStagesError, match=r"\[2, 1\] layers"):
        KVConnectorFactory.create_connector(
            config=cfg, role=role, kv_cache_config=vh.make_kv_cache_config(cfg, 64)
        )
