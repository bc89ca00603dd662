"""Qwen3-Next through vLLM's real Scheduler: gated-delta-net linear attention at layers 0-2 and
full attention at 3, planned by vLLM 0.33 into 4 KV cache groups (three state groups of one
layer, one attention group), block size raised (to 32 with bfloat16 states, 64 with float32 ones;
every test runs with both, `ssm_state_dtype`) so an attention page holds a state page.
Boundary states are stored from vLLM's hand-offs; a hit restores every group's state exactly and
the attention KV bit-identically; a hit is reported only up to the last boundary whose state
every group can read (the missing-state guard), and a state that vanishes between lookup and
load fails the request's load through `failed_recving`, so vLLM recomputes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import hybrid_helpers as hh
from helpers import ssm_model as sm
from helpers import vllm_harness as vh
from helpers.vllm_versions import needs_kv_groups

from flexkv_py.config import load_config
from flexkv_py.index.tier_names import Tier

# Several KV cache groups: vLLM 0.31+ (compat.check_kv_groups).
pytestmark = [pytest.mark.usefixtures("connector_form"), needs_kv_groups]

HIT = 10  # prompts of HIT blocks + 5 tokens: vLLM checkpoints the states after block HIT - 1
SHORT = 6  # a shorter prompt's checkpoint: after block SHORT - 1
MAX_LEN = 2048
POOL_TOKENS = 2 * MAX_LEN  # the engines' block pool: two max-length requests
HOST = {"cpu_cache_gb": 0.01}
STATE_GROUPS, ATTN_GROUP = (0, 1, 2), 3


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sm.jamba_model_dir(tmp_path_factory.mktemp("qwen3next"), sm.QWEN3NEXT_CONFIG)


@pytest.fixture
def qwen(qwen_dir: str, ssm_state_dtype: str) -> sm.Planned:
    """vLLM's plan for the model with the state dtype under test (in force for the test)."""
    return sm.plan(qwen_dir, "qwen3next", ssm_state_dtype)


def prompt_len(p: sm.Planned, blocks: int = HIT) -> int:
    return blocks * p.block_size + 5


def engine(p: sm.Planned, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("failure_policy",) if k in kw}
    e = vh.Engine(
        p.model_dir,
        vh.connector_transfer_config(extra, **transfer_kw),
        hybrid="qwen3next",
        num_blocks=p.blocks(POOL_TOKENS),
        max_model_len=MAX_LEN,
        **kw,
    )
    assert e.block_size == p.block_size  # the connector leaves vLLM's block size alone
    kinds = [type(g.kv_cache_spec).__name__ for g in e.kv_cache_config.kv_cache_groups]
    assert kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    return e


def request(p: sm.Planned, req_id: str, prompt: list[int]) -> Any:
    return vh.make_request(req_id, prompt, max_tokens=3, block_size=p.block_size)


def state_key(e: vh.Engine, group: int, req: Any, blocks: int) -> bytes:
    """The logical key of `group`'s state after `blocks` blocks of `req`."""
    (side,) = e.flexkv_scheduler_sides()
    return side._info.groups[group].namespace.key(req.block_hashes[blocks - 1])


def test_qwen3next_external_hit_restores_every_state_and_kv(qwen: sm.Planned) -> None:
    e = engine(qwen, HOST)
    bs, n = qwen.block_size, prompt_len(qwen)
    prompt = vh.prompt_tokens(21, n)
    a = e.add(request(qwen, "A", prompt))
    e.run_until(lambda: a.num_computed_tokens >= HIT * bs)
    states_a = [hh.group_bits(e, "A", g, HIT - 1, HIT) for g in STATE_GROUPS]
    attn_a = hh.group_bits(e, "A", ATTN_GROUP, 0, HIT)
    e.run()
    for g in STATE_GROUPS:
        assert hh.stat_total(e, f"group{g}_store_blocks") >= 1, f"group {g}: no state stored"
    e.reset_gpu_prefix_cache()

    e.add(request(qwen, "B", prompt))
    e.run_until(lambda: hh.loaded(e, "B"))
    # Loaded, not yet read: each state block is the one vLLM allocated at the hit's end.
    for g, bits in zip(STATE_GROUPS, states_a, strict=True):
        assert hh.same(hh.group_bits(e, "B", g, HIT - 1, HIT), bits), f"group {g} state"
    assert hh.same(hh.group_bits(e, "B", ATTN_GROUP, 0, HIT), attn_a)
    e.run()
    m = e.workers[0].model
    assert m.written["B"] == n - HIT * bs + 2  # only the tail after the hit
    assert m.checked["B"] >= HIT * bs + 1  # every position, then the states, at the join
    for g in STATE_GROUPS:
        assert hh.stat_total(e, f"group{g}_load_blocks") == 1
    assert hh.stat_total(e, f"group{ATTN_GROUP}_load_blocks") == HIT
    assert e.outputs["A"] == e.outputs["B"]
    assert not any(rec.invalid_block_ids or rec.failed_recving for rec in e.history)
    hh.finish_clean(e)


def store_two_boundaries(p: sm.Planned, ssd_dir: Path, prompt: list[int]) -> tuple[Any, Any]:
    """An engine with an SSD tier computes prompt[:SHORT blocks + 5] (states after SHORT
    blocks), then the whole prompt (states after HIT blocks), and shuts down."""
    e = engine(p, vh.with_ssd(ssd_dir))
    e.add(request(p, "A1", prompt[: prompt_len(p, SHORT)]))
    e.run()
    a2 = e.add(request(p, "A2", prompt))
    e.run()
    e.shutdown()
    assert e.workers[0].model.written["A2"] < len(prompt)  # A2 resumed from A1's states
    return e, a2


def delete_on_ssd(ssd_dir: Path, e: vh.Engine, keys: list[bytes]) -> None:
    """Delete logical keys from the (closed) rank-0 shard, as a lost or evicted file would."""
    from flexkv_py._native import BlockStore

    (side,) = e.flexkv_scheduler_sides()
    ns = side._info.namespace.for_rank(0, 0)
    capacity = ns.lower_tier_share(load_config(vh.with_ssd(ssd_dir)).ssd_cache_bytes)
    with BlockStore(str(ssd_dir / ns.shard_dir_name), capacity) as store:
        for key in keys:
            assert store.delete(ns.storage_key(key)), "key not on the SSD"


def test_missing_state_shortens_hit_to_last_readable_boundary(
    qwen: sm.Planned, tmp_path: Path
) -> None:
    n = prompt_len(qwen)
    prompt = vh.prompt_tokens(22, n)
    e1, a2 = store_two_boundaries(qwen, tmp_path / "ssd", prompt)
    # One group's state after HIT blocks is gone; its attention blocks and the other groups'
    # states stay.
    delete_on_ssd(tmp_path / "ssd", e1, [state_key(e1, 1, a2, HIT)])
    e2 = engine(qwen, vh.with_ssd(tmp_path / "ssd"))
    assert e2.flexkv_scheduler_sides()[0]._mgr.known(state_key(e1, 0, a2, HIT))
    e2.add(request(qwen, "B", prompt))
    e2.run()
    assert hh.loaded(e2, "B")
    # The hit ends after SHORT blocks, the last boundary where all three groups have a state.
    assert e2.workers[0].model.written["B"] == n - SHORT * qwen.block_size + 2
    assert hh.stat_total(e2, f"group{ATTN_GROUP}_load_blocks") == SHORT
    assert not any(rec.failed_recving for rec in e2.history)
    assert e2.outputs["B"] == e1.outputs["A2"]
    hh.finish_clean(e2)


def test_state_vanishing_between_lookup_and_load_fails_via_failed_recving(
    qwen: sm.Planned, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = prompt_len(qwen)
    prompt = vh.prompt_tokens(23, n)
    e1, a2 = store_two_boundaries(qwen, tmp_path / "ssd", prompt)
    e2 = engine(qwen, vh.with_ssd(tmp_path / "ssd"), failure_policy="recompute")
    (side,) = e2.flexkv_scheduler_sides()
    lookup = side.get_num_new_matched_tokens
    ssd = e2.workers[0].connector.worker_side.executor.tiers[Tier.SSD]
    ns = side._info.namespace.for_rank(0, 0)
    vanished: list[int] = []

    def lookup_then_lose_state(request: Any, num_computed_tokens: int) -> Any:
        got = lookup(request, num_computed_tokens)
        if request.request_id == "B" and got[0] and not vanished:
            # The lookup saw the state after HIT blocks; the SSD loses it before the load.
            vanished.append(got[0])
            assert ssd.store.delete(ns.storage_key(state_key(e1, 2, a2, HIT)))
        return got

    monkeypatch.setattr(side, "get_num_new_matched_tokens", lookup_then_lose_state)
    b = e2.add(request(qwen, "B", prompt))
    e2.run()
    assert vanished == [HIT * qwen.block_size]
    # vLLM dropped the failed load and asked again: the lookup now ends after SHORT blocks,
    # the boundary whose states are all still there, and B computes the rest (never the lost
    # state).
    written = n - SHORT * qwen.block_size + 2
    hh.assert_load_failed_then_recomputed(e2, b, written, e1.outputs["A2"])


def test_qwen3next_corrupt_ssd_recomputes_via_failed_recving(
    qwen: sm.Planned, tmp_path: Path
) -> None:
    n = prompt_len(qwen)
    prompt = vh.prompt_tokens(24, n)
    e1, _ = store_two_boundaries(qwen, tmp_path / "ssd", prompt)
    assert vh.corrupt_ssd(tmp_path / "ssd") >= 1
    e2 = engine(qwen, vh.with_ssd(tmp_path / "ssd"), failure_policy="recompute")
    b = e2.add(request(qwen, "B", prompt))
    e2.run()
    hh.assert_load_failed_then_recomputed(e2, b, n + 2, e1.outputs["A2"])
