"""Qwen3-Next through vLLM's real Scheduler: gated-delta-net linear attention at layers 0-2 and
full attention at 3, planned by vLLM 0.33 into 4 KV cache groups (three state groups of one
layer, one attention group), block size raised to 64 so an attention page holds a state page.
Boundary states are stored from vLLM's hand-offs; a hit restores every group's state exactly and
the attention KV bit-identically; a hit is reported only up to the last boundary whose state
every group can read (the missing-state guard), and a state that vanishes between lookup and
load fails the request's load through `failed_recving`, so vLLM recomputes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hybrid_helpers as hh
import pytest
import ssm_model as sm
import vllm_harness as vh

from flexkv_py.config import load_config
from flexkv_py.index.tier_names import Tier

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 64
PROMPT = 10 * BS + 5  # vLLM checkpoints the states at the prompt's last full block: 640
HIT = 10
SHORT = 6  # a shorter prompt's checkpoint: 384
HOST = {"cpu_cache_gb": 0.01}
STATE_GROUPS, ATTN_GROUP = (0, 1, 2), 3


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sm.jamba_model_dir(tmp_path_factory.mktemp("qwen3next"), sm.QWEN3NEXT_CONFIG)


def engine(model_dir: str, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("failure_policy",) if k in kw}
    kw.setdefault("num_blocks", 64)
    kw.setdefault("max_model_len", 2048)
    e = vh.Engine(
        model_dir, vh.connector_transfer_config(extra, **transfer_kw), hybrid="qwen3next", **kw
    )
    assert e.block_size == BS
    kinds = [type(g.kv_cache_spec).__name__ for g in e.kv_cache_config.kv_cache_groups]
    assert kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    return e


def request(req_id: str, prompt: list[int]) -> Any:
    return vh.make_request(req_id, prompt, max_tokens=3, block_size=BS)


def state_key(e: vh.Engine, group: int, req: Any, blocks: int) -> bytes:
    """The logical key of `group`'s state after `blocks` blocks of `req`."""
    (side,) = e.flexkv_scheduler_sides()
    return side._info.groups[group].namespace.key(req.block_hashes[blocks - 1])


def test_qwen3next_external_hit_restores_every_state_and_kv(qwen_dir: str) -> None:
    e = engine(qwen_dir, HOST)
    prompt = vh.prompt_tokens(21, PROMPT)
    a = e.add(request("A", prompt))
    e.run_until(lambda: a.num_computed_tokens >= HIT * BS)
    states_a = [hh.group_bits(e, "A", g, HIT - 1, HIT) for g in STATE_GROUPS]
    attn_a = hh.group_bits(e, "A", ATTN_GROUP, 0, HIT)
    e.run()
    for g in STATE_GROUPS:
        assert hh.stat_total(e, f"group{g}_store_blocks") >= 1, f"group {g}: no state stored"
    e.reset_gpu_prefix_cache()

    e.add(request("B", prompt))
    e.run_until(lambda: hh.loaded(e, "B"))
    # Loaded, not yet read: each state block is the one vLLM allocated at the hit's end.
    for g, bits in zip(STATE_GROUPS, states_a, strict=True):
        assert hh.same(hh.group_bits(e, "B", g, HIT - 1, HIT), bits), f"group {g} state"
    assert hh.same(hh.group_bits(e, "B", ATTN_GROUP, 0, HIT), attn_a)
    e.run()
    m = e.workers[0].model
    assert m.written["B"] == PROMPT - HIT * BS + 2  # only the tail after the hit
    assert m.checked["B"] >= HIT * BS + 1  # every position, then the states, at the join
    for g in STATE_GROUPS:
        assert hh.stat_total(e, f"group{g}_load_blocks") == 1
    assert hh.stat_total(e, f"group{ATTN_GROUP}_load_blocks") == HIT
    assert e.outputs["A"] == e.outputs["B"]
    assert not any(rec.invalid_block_ids or rec.failed_recving for rec in e.history)
    hh.finish_clean(e)


def store_two_boundaries(model_dir: str, ssd_dir: Path, prompt: list[int]) -> tuple[Any, Any]:
    """An engine with an SSD tier computes prompt[:SHORT blocks + 5] (states at 384), then the
    whole prompt (states at 640), and shuts down."""
    e = engine(model_dir, vh.with_ssd(ssd_dir))
    e.add(request("A1", prompt[: SHORT * BS + 5]))
    e.run()
    a2 = e.add(request("A2", prompt))
    e.run()
    e.shutdown()
    assert e.workers[0].model.written["A2"] < PROMPT  # A2 resumed from A1's states
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
    qwen_dir: str, tmp_path: Path
) -> None:
    prompt = vh.prompt_tokens(22, PROMPT)
    e1, a2 = store_two_boundaries(qwen_dir, tmp_path / "ssd", prompt)
    # One group's state at 640 is gone; its attention blocks and the other groups' states stay.
    delete_on_ssd(tmp_path / "ssd", e1, [state_key(e1, 1, a2, HIT)])
    e2 = engine(qwen_dir, vh.with_ssd(tmp_path / "ssd"))
    assert e2.flexkv_scheduler_sides()[0]._mgr.known(state_key(e1, 0, a2, HIT))
    e2.add(request("B", prompt))
    e2.run()
    assert hh.loaded(e2, "B")
    # The hit ends at 384, the last boundary where all three groups have a state.
    assert e2.workers[0].model.written["B"] == PROMPT - SHORT * BS + 2
    assert hh.stat_total(e2, f"group{ATTN_GROUP}_load_blocks") == SHORT
    assert not any(rec.failed_recving for rec in e2.history)
    assert e2.outputs["B"] == e1.outputs["A2"]
    hh.finish_clean(e2)


def test_state_vanishing_between_lookup_and_load_fails_via_failed_recving(
    qwen_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = vh.prompt_tokens(23, PROMPT)
    e1, a2 = store_two_boundaries(qwen_dir, tmp_path / "ssd", prompt)
    e2 = engine(qwen_dir, vh.with_ssd(tmp_path / "ssd"), failure_policy="recompute")
    (side,) = e2.flexkv_scheduler_sides()
    lookup = side.get_num_new_matched_tokens
    ssd = e2.workers[0].connector.worker_side.executor.tiers[Tier.SSD]
    ns = side._info.namespace.for_rank(0, 0)
    vanished: list[int] = []

    def lookup_then_lose_state(request: Any, num_computed_tokens: int) -> Any:
        got = lookup(request, num_computed_tokens)
        if request.request_id == "B" and got[0] and not vanished:
            # The lookup saw the state at 640; the SSD loses it before the load reads it.
            vanished.append(got[0])
            assert ssd.store.delete(ns.storage_key(state_key(e1, 2, a2, HIT)))
        return got

    monkeypatch.setattr(side, "get_num_new_matched_tokens", lookup_then_lose_state)
    b = e2.add(request("B", prompt))
    e2.run()
    assert vanished == [HIT * BS]
    # vLLM dropped the failed load and asked again: the lookup now ends at 384, the boundary
    # whose states are all still there, and B computes the rest (never the lost state).
    hh.assert_load_failed_then_recomputed(e2, b, PROMPT - SHORT * BS + 2, e1.outputs["A2"])


def test_qwen3next_corrupt_ssd_recomputes_via_failed_recving(qwen_dir: str, tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(24, PROMPT)
    e1, _ = store_two_boundaries(qwen_dir, tmp_path / "ssd", prompt)
    assert vh.corrupt_ssd(tmp_path / "ssd") >= 1
    e2 = engine(qwen_dir, vh.with_ssd(tmp_path / "ssd"), failure_policy="recompute")
    b = e2.add(request("B", prompt))
    e2.run()
    hh.assert_load_failed_then_recomputed(e2, b, PROMPT + 2, e1.outputs["A2"])
