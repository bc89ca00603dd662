"""KV cache groups with different block sizes (vLLM's hybrid allocator evens out page sizes by
raising a group's block size): a Gemma-4-shaped model (helpers/block_size_model.py) whose
sliding-window layers have half the head size of its full-attention ones, so vLLM plans the
sliding-window group at 32 tokens per block and the full-attention group at 16, hashes every
16 tokens and schedules in multiples of 32. Planned by vLLM 0.33's own code and run by its
real Scheduler; each group keys its blocks at its own block size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import block_size_model as bm
from helpers import hybrid_helpers as hh
from helpers import vllm_harness as vh
from helpers.vllm_versions import needs_kv_groups
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.request import RequestStatus

# Several KV cache groups: vLLM 0.31+ (compat.check_kv_groups).
pytestmark = [pytest.mark.usefixtures("connector_form"), needs_kv_groups]

SWA_GROUP, FULL_GROUP = 0, 1
HASH_BS, SWA_BS = 16, 32
PROMPT = 10 * SWA_BS  # 320 tokens: 20 full-attention blocks, 10 sliding-window blocks
HOST = {"cpu_cache_gb": 0.01}


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return bm.gemma4_model_dir(tmp_path_factory.mktemp("gemma4"))


def engine(model_dir: str, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("failure_policy",) if k in kw}
    kw.setdefault("num_blocks", 64)
    e = vh.Engine(
        model_dir, vh.connector_transfer_config(extra, **transfer_kw), hybrid="gemma4", **kw
    )
    assert (e.block_size, e.scheduler_block_size) == (HASH_BS, SWA_BS)
    return e


def request(req_id: str, prompt: list[int]) -> Any:
    return vh.make_request(req_id, prompt, max_tokens=3, block_size=HASH_BS)


def prompt_done(req: Any) -> Any:
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def test_vllm_plans_different_block_sizes_with_our_connector(gemma4_dir: str) -> None:
    with hh.vllm_config_warnings() as seen:
        cfg = vh.make_vllm_config(gemma4_dir, vh.connector_transfer_config())
    cfg.model_config.max_model_len = cfg.scheduler_config.max_model_len = 512
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert not [m for m in seen if hh.TURNING_OFF in m]
    plan = bm.plan_kv_cache(cfg, 2048)
    groups = [
        (type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size) for g in plan.kv_cache_groups
    ]
    assert groups == [("SlidingWindowSpec", SWA_BS), ("FullAttentionSpec", HASH_BS)]
    assert plan.num_blocks == 2048
    assert resolve_kv_cache_block_sizes(plan, cfg) == (SWA_BS, HASH_BS)


def test_external_hit_is_bit_identical_in_both_groups(gemma4_dir: str) -> None:
    e = engine(gemma4_dir, HOST)
    prompt = vh.prompt_tokens(11, PROMPT)
    a = e.add(request("A", prompt))
    e.run_until(prompt_done(a))
    full_a = hh.group_bits(e, "A", FULL_GROUP, 0, PROMPT // HASH_BS)
    # The window (127 tokens) before 320 lies in sliding-window blocks 6..9.
    swa_a = hh.group_bits(e, "A", SWA_GROUP, 6, PROMPT // SWA_BS)
    e.run()
    assert hh.stat_total(e, f"group{SWA_GROUP}_store_blocks") > 0
    assert hh.stat_total(e, f"group{FULL_GROUP}_store_blocks") >= PROMPT // HASH_BS
    e.reset_gpu_prefix_cache()

    b = e.add(request("B", prompt))
    e.run_until(lambda: hh.loaded(e, "B"))
    assert hh.same(hh.group_bits(e, "B", FULL_GROUP, 0, PROMPT // HASH_BS), full_a)
    assert hh.same(hh.group_bits(e, "B", SWA_GROUP, 6, PROMPT // SWA_BS), swa_a)
    e.run_until(prompt_done(b))
    m = e.workers[0].model
    assert m.written["B"] == 1  # the hit is the whole prompt: only its last token recomputed
    assert m.checked["B"] >= PROMPT - 1
    assert hh.stat_total(e, f"group{SWA_GROUP}_load_blocks") == 4  # only the window's blocks
    assert hh.stat_total(e, f"group{FULL_GROUP}_load_blocks") == PROMPT // HASH_BS
    e.run()
    assert e.outputs["A"] == e.outputs["B"]
    assert not any(rec.invalid_block_ids or rec.failed_recving for rec in e.history)
    hh.finish_clean(e)


def store_on_ssd(model_dir: str, ssd_dir: Path, prompt: list[int]) -> list[int]:
    """An engine computes `prompt` with an SSD tier and shuts down; its request's output."""
    return hh.compute_and_shut_down(engine(model_dir, vh.with_ssd(ssd_dir)), request("A", prompt))


def test_restart_same_ssd_dir_hits(gemma4_dir: str, tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(12, PROMPT)
    outputs = store_on_ssd(gemma4_dir, tmp_path / "ssd", prompt)
    e2 = engine(gemma4_dir, vh.with_ssd(tmp_path / "ssd"))
    b = e2.add(request("B", prompt))
    e2.run_until(prompt_done(b))
    assert hh.loaded(e2, "B")
    assert e2.workers[0].model.written["B"] == 1
    e2.run()
    assert e2.outputs["B"] == outputs
    hh.finish_clean(e2)


def test_corrupt_ssd_recomputes_via_failed_recving(gemma4_dir: str, tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(13, PROMPT)
    ssd = tmp_path / "ssd"
    # Recomputed in full.
    hh.assert_corrupt_ssd_recomputes(engine, request, gemma4_dir, ssd, prompt, PROMPT + 2)


def test_hit_ends_on_the_scheduler_block_size(gemma4_dir: str) -> None:
    # A prompt of 19 hash blocks (304 tokens): the full-attention group has 19 blocks stored,
    # the sliding-window group 9 (288 tokens). A hit must end on a multiple of 32 tokens.
    e = engine(gemma4_dir, HOST)
    prompt = vh.prompt_tokens(14, 19 * HASH_BS)
    e.add(request("A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    b = e.add(request("B", prompt))
    e.run_until(prompt_done(b))
    assert hh.loaded(e, "B")
    assert e.workers[0].model.written["B"] == 19 * HASH_BS - 9 * SWA_BS
    assert hh.stat_total(e, f"group{FULL_GROUP}_load_blocks") == 9 * SWA_BS // HASH_BS
    e.run()
    hh.finish_clean(e, "A", "B")


def test_kv_events_carry_each_groups_block_size(
    gemma4_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")
    e = engine(gemma4_dir, HOST)
    a = e.add(request("A", vh.prompt_tokens(15, PROMPT)))
    e.run()
    e.shutdown()
    stored = [ev for ev in e.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    swa = [ev for ev in stored if ev.group_idx == SWA_GROUP]
    full = [ev for ev in stored if ev.group_idx == FULL_GROUP]
    assert swa and full
    assert {ev.block_size for ev in swa} == {SWA_BS}
    assert {ev.block_size for ev in full} == {HASH_BS}
    # A sliding-window block is keyed by the hash ending at its last token, and its event
    # names all its 32 tokens and the block before it, as vLLM's own events would.
    by_hash = {ev.block_hashes[0]: ev for ev in swa}
    last = maybe_convert_block_hash(a.block_hashes[PROMPT // HASH_BS - 1])
    ev = by_hash[last]
    assert ev.token_ids == a.prompt_token_ids[PROMPT - SWA_BS : PROMPT]
    assert ev.parent_block_hash == maybe_convert_block_hash(a.block_hashes[PROMPT // HASH_BS - 3])


def test_restart_announces_each_groups_blocks_whole(
    gemma4_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    prompt = vh.prompt_tokens(16, PROMPT)
    e1 = engine(gemma4_dir, vh.with_ssd(tmp_path / "ssd"))
    a = e1.add(request("A", prompt))
    e1.run()
    e1.shutdown()
    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")
    e2 = engine(gemma4_dir, vh.with_ssd(tmp_path / "ssd"))
    last = maybe_convert_block_hash(a.block_hashes[PROMPT // HASH_BS - 1])

    def announced(group: int) -> dict[object, BlockStored]:
        return {
            ev.block_hashes[0]: ev
            for ev in e2.events
            if isinstance(ev, BlockStored)
            and ev.medium == "DISK"
            and ev.token_ids
            and ev.group_idx == group
        }

    e2.run_until(lambda: last in announced(SWA_GROUP) and last in announced(FULL_GROUP), 30)
    swa, full = announced(SWA_GROUP)[last], announced(FULL_GROUP)[last]
    # The SSD kept each sliding-window block's 32 tokens and its parent, the block before it.
    assert (swa.block_size, swa.token_ids) == (SWA_BS, prompt[PROMPT - SWA_BS : PROMPT])
    assert swa.parent_block_hash == maybe_convert_block_hash(a.block_hashes[PROMPT // HASH_BS - 3])
    assert (full.block_size, full.token_ids) == (HASH_BS, prompt[PROMPT - HASH_BS : PROMPT])
    assert swa.kv_cache_spec_kind != full.kv_cache_spec_kind
    e2.shutdown()


def test_tp2_each_rank_restores_its_shard(gemma4_dir: str) -> None:
    e = engine(gemma4_dir, HOST, tp_size=2)
    prompt = vh.prompt_tokens(17, PROMPT + 5)
    e.add(request("A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(request("B", prompt))
    e.run()
    assert hh.loaded(e, "B")
    for w in e.workers:
        assert w.model.written["B"] == 5 + 2, f"rank {w.model.rank} recomputed"
    hh.finish_clean(e, "A", "B")


def test_preemption_keeps_kv_correct(gemma4_dir: str) -> None:
    # 24 blocks for 3 requests that each grow to 214 tokens (14 full-attention blocks and the
    # window's sliding-window blocks): decode must preempt.
    e = engine(gemma4_dir, HOST, num_blocks=24, max_model_len=224)
    reqs = [
        e.add(
            vh.make_request(
                f"P{i}", vh.prompt_tokens(50 + i, 64), max_tokens=150, block_size=HASH_BS
            )
        )
        for i in range(3)
    ]
    e.run(timeout_s=300)
    assert any(r.num_preemptions > 0 for r in reqs), "scenario did not preempt"
    assert all(len(e.outputs[r.request_id]) == 150 for r in reqs)
    hh.finish_clean(e)
