"""State-space hybrids (vLLM's hybrid KV cache manager with a Mamba group) with FlexKVConnectorV1:
a Jamba-shaped model (tests/ssm_model.py), planned by vLLM 0.33's own code and run by its real
Scheduler on CPU tensors. vLLM keeps Mamba state per block boundary in "align" mode and hands the
boundary states it caches to the connector; a hit must restore the state after its last block
exactly, and every attention block bit-identical, at the first step that reads them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hybrid_helpers as hh
import pytest
import ssm_model as sm
import vllm_harness as vh

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 96  # vLLM raises Jamba's block size from 16 until an attention page holds a state page
PROMPT = 10 * BS + 5  # vLLM checkpoints the state at the prompt's last full block: 960
HIT = 10
HOST = {"cpu_cache_gb": 0.01}
STATE_GROUP, ATTN_GROUP = 0, 1


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sm.jamba_model_dir(tmp_path_factory.mktemp("jamba"))


def engine(model_dir: str, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("failure_policy",) if k in kw}
    kw.setdefault("num_blocks", 64)
    kw.setdefault("max_model_len", 2048)
    e = vh.Engine(
        model_dir, vh.connector_transfer_config(extra, **transfer_kw), hybrid="jamba", **kw
    )
    assert e.block_size == BS
    return e


def request(req_id: str, prompt: list[int]) -> Any:
    return vh.make_request(req_id, prompt, max_tokens=3, block_size=BS)


def computed(req: Any, n: int) -> Any:
    return lambda: req.num_computed_tokens >= n


@pytest.fixture
def vllm_warnings() -> Iterator[list[str]]:
    with hh.vllm_config_warnings() as seen:
        yield seen


# ----------------------------------------------------------------------------- HMA and plan
def test_jamba_keeps_hma_and_as_many_blocks_as_without_connector(
    jamba_dir: str, vllm_warnings: list[str]
) -> None:
    def plan(transfer: dict[str, Any] | None) -> Any:
        cfg = vh.make_vllm_config(jamba_dir, transfer)
        assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert cfg.cache_config.mamba_cache_mode == "align"
        assert sm.align_block_size(cfg) == BS
        return sm.plan_jamba_kv_cache(cfg, 2048)

    bare, ours = plan(None), plan(vh.connector_transfer_config())
    assert bare.num_blocks == ours.num_blocks == 2048
    assert [type(g.kv_cache_spec).__name__ for g in ours.kv_cache_groups] == [
        "MambaSpec",
        "FullAttentionSpec",
    ]
    assert not [m for m in vllm_warnings if hh.TURNING_OFF in m]


# ----------------------------------------------------------------------------- store / load
def test_jamba_external_hit_restores_exact_state_and_kv(jamba_dir: str) -> None:
    e = engine(jamba_dir, HOST)
    prompt = vh.prompt_tokens(1, PROMPT)
    a = e.add(request("A", prompt))
    # The step that computes token 960 writes the state vLLM hands off for that boundary.
    e.run_until(computed(a, HIT * BS))
    state_a = hh.group_bits(e, "A", STATE_GROUP, HIT - 1, HIT)
    attn_a = hh.group_bits(e, "A", ATTN_GROUP, 0, HIT)
    e.run()
    assert hh.stat_total(e, "group0_store_blocks") >= 1, "no boundary state was stored"
    e.reset_gpu_prefix_cache()

    e.add(request("B", prompt))
    e.run_until(lambda: hh.loaded(e, "B"))
    # Loaded, not yet read: the state block is the one vLLM allocated at the hit's end.
    assert hh.same(hh.group_bits(e, "B", STATE_GROUP, HIT - 1, HIT), state_a)
    assert hh.same(hh.group_bits(e, "B", ATTN_GROUP, 0, HIT), attn_a)
    e.run()
    m = e.workers[0].model
    assert m.written["B"] == PROMPT - HIT * BS + 2  # only the tail after the hit
    assert m.checked["B"] >= HIT * BS + 1  # every position, then the state, at the join
    assert hh.stat_total(e, "group0_load_blocks") == 1  # one state block
    assert hh.stat_total(e, "group1_load_blocks") == HIT
    assert e.outputs["A"] == e.outputs["B"]
    assert not e.mismatches()
    assert not any(rec.invalid_block_ids or rec.failed_recving for rec in e.history)
    vh.assert_no_leaks(e)
    e.shutdown()


def test_jamba_hit_needs_a_state_at_its_end(jamba_dir: str) -> None:
    # A's attention blocks 0..9 are stored, but vLLM hands off A's state only at 960 (its
    # prompt's checkpoint). B shares A's first 8 blocks: no state exists at 768, so nothing
    # can resume there and B computes all of it.
    e = engine(jamba_dir, HOST)
    prompt = vh.prompt_tokens(2, PROMPT)
    e.add(request("A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    b_prompt = vh.prompt_tokens(3, PROMPT, prefix=prompt[: 8 * BS])
    e.add(request("B", b_prompt))
    e.run()
    assert not hh.loaded(e, "B")
    assert e.workers[0].model.written["B"] == PROMPT + 2
    hh.finish_clean(e)


# ----------------------------------------------------------------------------- SSD
def store_on_ssd(model_dir: str, ssd_dir: Path, prompt: list[int]) -> list[int]:
    """An engine computes `prompt` with an SSD tier and shuts down; its request's output."""
    return hh.compute_and_shut_down(engine(model_dir, vh.with_ssd(ssd_dir)), request("A", prompt))


def test_jamba_restart_same_ssd_dir_hits(jamba_dir: str, tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(4, PROMPT)
    outputs = store_on_ssd(jamba_dir, tmp_path / "ssd", prompt)
    e2 = engine(jamba_dir, vh.with_ssd(tmp_path / "ssd"))
    e2.add(request("B", prompt))
    e2.run()
    assert hh.loaded(e2, "B")
    assert e2.workers[0].model.written["B"] == PROMPT - HIT * BS + 2
    assert e2.outputs["B"] == outputs
    hh.finish_clean(e2)


def test_jamba_corrupt_ssd_recomputes_via_failed_recving(jamba_dir: str, tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(5, PROMPT)
    ssd = tmp_path / "ssd"
    # Recomputed in full.
    hh.assert_corrupt_ssd_recomputes(engine, request, jamba_dir, ssd, prompt, PROMPT + 2)


def test_jamba_kv_events_name_the_state_group(
    jamba_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")
    e = engine(jamba_dir, HOST)
    a = e.add(request("A", vh.prompt_tokens(6, PROMPT)))
    e.run()
    e.shutdown()
    stored = [ev for ev in e.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    state = [ev for ev in stored if ev.group_idx == STATE_GROUP]
    # One state, the one after block 9 (960 tokens), announced under the Mamba group.
    assert [ev.block_hashes for ev in state] == [[maybe_convert_block_hash(a.block_hashes[9])]]
    assert state[0].kv_cache_spec_kind == "mamba"
    assert sum(len(ev.block_hashes) for ev in stored if ev.group_idx == ATTN_GROUP) == HIT


def test_jamba_tp2_each_rank_restores_its_state_shard(jamba_dir: str) -> None:
    e = engine(jamba_dir, HOST, tp_size=2)
    prompt = vh.prompt_tokens(7, PROMPT)
    e.add(request("A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(request("B", prompt))
    e.run()
    assert hh.loaded(e, "B")
    for w in e.workers:
        assert w.model.written["B"] == PROMPT - HIT * BS + 2, f"rank {w.model.rank} recomputed"
    hh.finish_clean(e, "A", "B")


def test_jamba_preemption_keeps_state_correct(jamba_dir: str) -> None:
    # 24 blocks of 96 tokens for 3 requests that each grow to 9 blocks: decode must preempt.
    e = engine(jamba_dir, HOST, num_blocks=24, max_model_len=1024)
    reqs = [
        e.add(
            vh.make_request(
                f"P{i}", vh.prompt_tokens(40 + i, 5 * BS), max_tokens=380, block_size=BS
            )
        )
        for i in range(3)
    ]
    e.run(timeout_s=300)
    assert any(r.num_preemptions > 0 for r in reqs), "scenario did not preempt"
    assert not e.mismatches()
    assert all(len(e.outputs[r.request_id]) == 380 for r in reqs)
    vh.assert_no_leaks(e)
    e.shutdown()


# ----------------------------------------------------------------------------- composition
@pytest.mark.parametrize("wrapper", ["MultiConnector", "PdConnector"])
def test_jamba_hma_declared_inside_wrappers_next_to_nixl(
    jamba_dir: str, wrapper: str, vllm_warnings: list[str]
) -> None:
    # A state-space model needs HMA: vLLM keeps it on only if every child of the wrapper
    # declares it (ours under the built-in name or the module path, and NIXL), and the wrapper
    # vLLM builds asserts the same; the Mamba group is then planned as without a connector.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

    ours: dict[str, Any] = {"kv_connector": vh.CONNECTOR, "kv_role": "kv_both"}
    if vh.CONNECTOR_FORM == "module_path":
        ours["kv_connector_module_path"] = vh.MODULE_PATH
    transfer: dict[str, Any] = {
        "kv_connector": wrapper,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [ours, {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]
        },
    }
    if wrapper == "PdConnector":
        transfer["kv_connector_module_path"] = "kvbm.vllm_integration.connector"
    cfg = vh.make_vllm_config(jamba_dir, transfer)
    assert cfg.kv_transfer_config is not None
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert not [m for m in vllm_warnings if hh.TURNING_OFF in m]
    sm.align_block_size(cfg)
    plan = sm.plan_jamba_kv_cache(cfg, 2048)
    assert plan.num_blocks == 2048
    assert type(plan.kv_cache_groups[STATE_GROUP].kv_cache_spec).__name__ == "MambaSpec"
    connector = KVConnectorFactory.create_connector(
        config=cfg, role=KVConnectorRole.SCHEDULER, kv_cache_config=plan
    )
    assert supports_hma(connector)
    children = connector._connectors  # type: ignore[attr-defined]
    assert type(children[0]).__name__ == "FlexKVConnectorV1"
    assert type(children[1]).__name__.startswith("Nixl")  # vLLM picks NIXL's variant
    assert all(supports_hma(c) for c in children)
    connector.shutdown()
