"""Hybrid models (vLLM's hybrid KV cache manager, HMA) with FlexKVConnectorV1: a Gemma-3-shaped
model, odd layers sliding-window, planned by vLLM 0.33's own KV planning and run by its real
Scheduler on CPU tensors (see vllm_harness). The FakeModel checks at the first step that reads
them that every full-attention block and every sliding-window block inside the window holds
exactly the KV the prefix implies."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import hybrid_helpers as hh
from helpers import vllm_harness as vh
from helpers.vllm_versions import needs_kv_groups
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16
PROMPT_BLOCKS = 20  # past the 128-token window: 8 blocks of it before a boundary
WINDOW_BLOCKS = -(-(vh.WINDOW - 1) // BS)
HOST = {"cpu_cache_gb": 0.01}
# A block-aligned prompt hits in full: vLLM recomputes only its last token, then decodes twice.
RECOMPUTED = 1 + 2


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vh.hybrid_model_dir(tmp_path_factory.mktemp("hybrid"))


def engine(model_dir: str, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("failure_policy",) if k in kw}
    kw.setdefault("num_blocks", 128)
    return vh.Engine(
        model_dir, vh.connector_transfer_config(extra, **transfer_kw), hybrid=True, **kw
    )


def prompt_done(req: Any) -> Any:
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


@pytest.fixture
def vllm_warnings() -> Iterator[list[str]]:
    with hh.vllm_config_warnings() as seen:
        yield seen


# ----------------------------------------------------------------------------- HMA decision
NIXL_CHILDREN = [
    {"kv_connector": "FlexKVConnectorV1", "kv_role": "kv_both"},
    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
]


@pytest.mark.parametrize("launch", ["connector", "MultiConnector", "PdConnector"])
def test_hma_stays_on_builtin_module_path_multiconnector_pd(
    hybrid_dir: str, launch: str, vllm_warnings: list[str]
) -> None:
    transfer = {
        "connector": vh.connector_transfer_config(),
        "MultiConnector": {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": NIXL_CHILDREN},
        },
        "PdConnector": {
            "kv_connector": "PdConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "kvbm.vllm_integration.connector",
            "kv_connector_extra_config": {"connectors": NIXL_CHILDREN},
        },
    }[launch]
    cfg = vh.make_vllm_config(hybrid_dir, json.loads(json.dumps(transfer)))
    assert cfg.kv_transfer_config is not None
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert not [m for m in vllm_warnings if hh.TURNING_OFF in m]


@needs_kv_groups
def test_kv_plan_blocks_match_no_connector(hybrid_dir: str) -> None:
    def plan(transfer: dict[str, Any] | None, **kw: Any) -> Any:
        cfg = vh.make_vllm_config(hybrid_dir, transfer, **kw)
        per_block = vh.hybrid_block_bytes(cfg)
        return vh.plan_hybrid_kv_cache(cfg, 2048 * per_block)

    bare, ours = plan(None), plan(vh.connector_transfer_config())
    assert bare.num_blocks == ours.num_blocks == 2048
    assert len(ours.kv_cache_groups) == len(bare.kv_cache_groups) == 2
    # What our connector cost before SupportsHMA: HMA off, every layer full attention.
    assert plan(vh.connector_transfer_config(), disable_hma=True).num_blocks == 1024


# ----------------------------------------------------------------------------- store / load
@needs_kv_groups
def test_hybrid_store_then_external_hit_is_bit_identical(hybrid_dir: str) -> None:
    e = engine(hybrid_dir, HOST)
    assert len(e.kv_cache_config.kv_cache_groups) == 2
    prompt = vh.prompt_tokens(1, PROMPT_BLOCKS * BS)
    hit = PROMPT_BLOCKS  # all of it: the last token's window lies inside the blocks loaded
    a = e.add(vh.make_request("A", prompt, max_tokens=3))
    e.run_until(prompt_done(a))
    # A computed all 20 blocks: its window (sliding group) starts at block 12.
    full_a = hh.group_bits(e, "A", 0, 0, hit)
    swa_a = hh.group_bits(e, "A", 1, 12, hit)
    e.run()
    assert hh.stat_total(e, "group1_store_blocks") > 0, "no sliding-window block was stored"
    e.reset_gpu_prefix_cache()

    b = e.add(vh.make_request("B", prompt, max_tokens=3))
    e.run_until(prompt_done(b))
    assert hh.loaded(e, "B")
    assert hh.same(hh.group_bits(e, "B", 0, 0, hit), full_a)
    assert hh.same(hh.group_bits(e, "B", 1, 12, hit), swa_a)
    e.run()
    m = e.workers[0].model
    assert m.written["B"] == RECOMPUTED
    assert m.checked["B"] >= len(prompt) - 1  # every position before the recomputed one
    # Full attention loads the whole hit, the sliding window only the window's blocks.
    assert hh.stat_total(e, "group0_load_blocks") == hit
    assert hh.stat_total(e, "group1_load_blocks") == WINDOW_BLOCKS
    assert hh.stat_total(e, "load_blocks") == hit + WINDOW_BLOCKS
    assert e.outputs["A"] == e.outputs["B"]
    assert not e.mismatches()
    assert not any(rec.invalid_block_ids or rec.failed_recving for rec in e.history)
    vh.assert_no_leaks(e)
    e.shutdown()


@needs_kv_groups
def test_hybrid_offload_during_chunked_prefill(hybrid_dir: str) -> None:
    # 64-token chunks: the sliding group frees (and vLLM reuses) blocks while A still prefills,
    # so stores of those blocks run under the reuse fence.
    e = engine(hybrid_dir, HOST, max_num_batched_tokens=64)
    hh.compute_then_reload(e, vh.prompt_tokens(2, PROMPT_BLOCKS * BS))
    assert e.workers[0].model.written["B"] == RECOMPUTED
    hh.finish_clean(e, "A", "B")


@needs_kv_groups
def test_hybrid_preemption_keeps_kv_correct(hybrid_dir: str) -> None:
    # 36 blocks for 3 requests that each grow past a third of them: decode must preempt.
    e = engine(hybrid_dir, HOST, num_blocks=36, max_model_len=256)
    reqs = [
        e.add(vh.make_request(f"P{i}", vh.prompt_tokens(40 + i, 8 * BS), max_tokens=110))
        for i in range(3)
    ]
    e.run()
    assert any(r.num_preemptions > 0 for r in reqs), "scenario did not preempt"
    assert not e.mismatches()
    assert all(len(e.outputs[r.request_id]) == 110 for r in reqs)
    vh.assert_no_leaks(e)
    e.shutdown()


@needs_kv_groups
def test_hybrid_tp2_each_rank_own_shard(hybrid_dir: str) -> None:
    e = engine(hybrid_dir, HOST, tp_size=2)
    hh.compute_then_reload(e, vh.prompt_tokens(5, PROMPT_BLOCKS * BS))
    for w in e.workers:
        assert w.model.written["B"] == RECOMPUTED, f"rank {w.model.rank} recomputed"
    hh.finish_clean(e, "A", "B")


# ----------------------------------------------------------------------------- SSD
@needs_kv_groups
def test_hybrid_restart_same_ssd_dir_hits(hybrid_dir: str, tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(6, PROMPT_BLOCKS * BS)
    e = engine(hybrid_dir, vh.with_ssd(tmp_path / "ssd"))
    e.add(vh.make_request("A", prompt, max_tokens=3))
    e.run()
    e.shutdown()
    e2 = engine(hybrid_dir, vh.with_ssd(tmp_path / "ssd"))
    e2.add(vh.make_request("B", prompt, max_tokens=3))
    e2.run()
    assert hh.loaded(e2, "B")
    assert e2.workers[0].model.written["B"] == RECOMPUTED
    assert e2.outputs["B"] == e.outputs["A"]
    hh.finish_clean(e2)


@needs_kv_groups
def test_hybrid_corrupt_ssd_fails_request_via_failed_recving(
    hybrid_dir: str, tmp_path: Path
) -> None:
    prompt = vh.prompt_tokens(7, PROMPT_BLOCKS * BS)
    e = engine(hybrid_dir, vh.with_ssd(tmp_path / "ssd"))
    e.add(vh.make_request("A", prompt, max_tokens=3))
    e.run()
    e.shutdown()
    assert vh.corrupt_ssd(tmp_path / "ssd") >= 1
    # vLLM's default policy under a standalone connector is "fail"; recompute is what the
    # issue asks for a corrupt tier.
    e2 = engine(hybrid_dir, vh.with_ssd(tmp_path / "ssd"), failure_policy="recompute")
    b = e2.add(vh.make_request("B", prompt, max_tokens=3))
    e2.run()
    # With two groups vLLM raises on block ids: the request fails as a whole instead.
    assert any("B" in rec.failed_recving for rec in e2.history), "corruption not reported"
    assert not any(rec.invalid_block_ids for rec in e2.history)
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert e2.workers[0].model.written["B"] == len(prompt) + 2  # recomputed in full
    assert e2.outputs["B"] == e.outputs["A"]
    hh.finish_clean(e2)


# ----------------------------------------------------------------------------- reuse fence
@needs_kv_groups
def test_swa_block_reused_while_store_pending_is_flushed(
    hybrid_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexkv_py.integration.vllm import worker_side

    # 29 usable blocks for a 15-block prompt in 64-token chunks: the sliding group frees blocks
    # out of the window while A prefills and vLLM hands them out again (A's own next chunk),
    # while every GPU->host copy is held back (a stuck copy engine, as in
    # test_vllm_flush_timeout). The fence makes the worker wait for the stores reading them,
    # then abandon them: a late copy of a rewritten block is never committed.
    monkeypatch.setattr(worker_side, "FLUSH_TIMEOUT_S", 0.05)
    e = engine(hybrid_dir, HOST, num_blocks=30, max_model_len=256, max_num_batched_tokens=64)
    prompt = vh.prompt_tokens(8, 15 * BS)
    gate = threading.Event()
    e.workers[0].connector.worker_side.executor.transfer._executors["d2h"].submit(gate.wait)
    try:
        a = e.add(vh.make_request("A", prompt, max_tokens=3))
        e.run_until(prompt_done(a))
        assert hh.stat_total(e, "flush_timeouts") >= 1, "no store was fenced"
    finally:
        gate.set()
    e.run()
    assert hh.stat_total(e, "store_abandoned_jobs") >= 1
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("B", prompt, max_tokens=3))
    e.run()
    assert e.outputs["B"] == e.outputs["A"]
    assert not e.mismatches()  # nothing B loaded came from a rewritten block
    vh.assert_no_leaks(e)
    e.shutdown()


# ----------------------------------------------------------------------------- refused kinds
def test_mamba_group_is_refused_by_name() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from flexkv_py.index.namespace import Namespace
    from flexkv_py.integration.vllm.engine_info import UnsupportedKVCacheError, read_groups

    mamba = MambaSpec(
        shapes=((2, 8), (16, 4)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        block_size=BS,
        mamba_type="mamba1",
    )
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    cfg = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["m0"], mamba), KVCacheGroupSpec(["a1"], attn)],
    )
    base = Namespace(
        model="jamba", revision=None, kv_dtype="bf16", kv_layout="LBNHC", block_size=BS
    )
    with pytest.raises(UnsupportedKVCacheError, match=r"kv_cache_groups\[0\].*Mamba"):
        read_groups(cfg, base)


@needs_kv_groups
def test_sliding_store_interval_stores_boundary_windows_and_hits_on_them(hybrid_dir: str) -> None:
    # Interval 16: the sliding group keeps the 8-block window before block 16 and A's last
    # window (12..19): 12 of 20 blocks. C shares A's first 17 blocks: the window before 17
    # (9..16) is among them, so C resumes at 17.
    e = engine(hybrid_dir, {**HOST, "sliding_store_interval_blocks": 16})
    prompt = vh.prompt_tokens(10, PROMPT_BLOCKS * BS)
    e.add(vh.make_request("A", prompt, max_tokens=3))
    e.run()
    assert hh.stat_total(e, "group1_store_blocks") == 12
    assert hh.stat_total(e, "group0_store_blocks") == PROMPT_BLOCKS
    e.reset_gpu_prefix_cache()
    c_prompt = vh.prompt_tokens(11, PROMPT_BLOCKS * BS, prefix=prompt[: 17 * BS])
    e.add(vh.make_request("C", c_prompt, max_tokens=3))
    e.run()
    assert hh.loaded(e, "C")
    assert e.workers[0].model.written["C"] == (PROMPT_BLOCKS - 17) * BS + 2
    assert hh.stat_total(e, "group1_load_blocks") == WINDOW_BLOCKS
    hh.finish_clean(e)


# ----------------------------------------------------------------------------- KV events
@needs_kv_groups
def test_hybrid_kv_events_name_each_group(hybrid_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")
    e = engine(hybrid_dir, HOST)
    a = e.add(vh.make_request("A", vh.prompt_tokens(9, PROMPT_BLOCKS * BS), max_tokens=3))
    e.run()
    e.shutdown()
    stored = [ev for ev in e.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    by_group: dict[int, set[Any]] = {}
    for ev in stored:
        by_group.setdefault(ev.group_idx, set()).update(ev.block_hashes)
        # What vLLM's KVCacheManager annotates its own events with, per group.
        want = ("full_attention", None) if ev.group_idx == 0 else ("sliding_window", vh.WINDOW)
        assert (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == want
    hashes = [maybe_convert_block_hash(h) for h in a.block_hashes]
    assert set(hashes[:PROMPT_BLOCKS]) <= by_group[0]
    # The sliding group's blocks are announced as its own, the last ones (in the window) too.
    assert hashes[PROMPT_BLOCKS - 1] in by_group[1]
