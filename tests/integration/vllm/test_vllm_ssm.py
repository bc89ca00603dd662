"""State-space hybrids (vLLM's hybrid KV cache manager with a Mamba group) with FlexKVConnectorV1:
a Jamba-shaped model (helpers/ssm_model.py), planned by vLLM 0.33's own code and run by its real
Scheduler on CPU tensors. vLLM keeps Mamba state per block boundary in "align" mode and hands the
boundary states it caches to the connector; a hit must restore the state after its last block
exactly, and every attention block bit-identical, at the first step that reads them. Every test
runs with bfloat16 and with float32 states (`ssm_state_dtype`): the block size (64 or 96) and
every size below follow from vLLM's plan for the dtype."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import hybrid_helpers as hh
from helpers import ssm_model as sm
from helpers import vllm_harness as vh
from helpers.vllm_versions import needs_kv_groups

# Several KV cache groups: vLLM 0.31+ (compat.check_kv_groups).
pytestmark = [pytest.mark.usefixtures("connector_form"), needs_kv_groups]

HIT = 10  # prompts of HIT blocks + 5 tokens: vLLM checkpoints the state after block HIT - 1
MAX_LEN = 2048
POOL_TOKENS = 2 * MAX_LEN  # the engines' block pool: two max-length requests
HOST = {"cpu_cache_gb": 0.01}
STATE_GROUP, ATTN_GROUP = 0, 1


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sm.jamba_model_dir(tmp_path_factory.mktemp("jamba"))


@pytest.fixture
def jamba(jamba_dir: str, ssm_state_dtype: str) -> sm.Planned:
    """vLLM's plan for the model with the state dtype under test (in force for the test)."""
    return sm.plan(jamba_dir, "jamba", ssm_state_dtype)


def prompt_len(p: sm.Planned) -> int:
    return HIT * p.block_size + 5


def engine(p: sm.Planned, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("failure_policy",) if k in kw}
    kw.setdefault("num_blocks", p.blocks(POOL_TOKENS))
    kw.setdefault("max_model_len", MAX_LEN)
    e = vh.Engine(
        p.model_dir, vh.connector_transfer_config(extra, **transfer_kw), hybrid="jamba", **kw
    )
    assert e.block_size == p.block_size  # the connector leaves vLLM's block size alone
    return e


def request(p: sm.Planned, req_id: str, prompt: list[int], max_tokens: int = 3) -> Any:
    return vh.make_request(req_id, prompt, max_tokens=max_tokens, block_size=p.block_size)


def computed(req: Any, n: int) -> Any:
    return lambda: req.num_computed_tokens >= n


@pytest.fixture
def vllm_warnings() -> Iterator[list[str]]:
    with hh.vllm_config_warnings() as seen:
        yield seen


# ----------------------------------------------------------------------------- HMA and plan
def test_jamba_keeps_hma_and_as_many_blocks_as_without_connector(
    jamba: sm.Planned, vllm_warnings: list[str]
) -> None:
    def plan(transfer: dict[str, Any] | None) -> Any:
        cfg = vh.make_vllm_config(jamba.model_dir, transfer)
        assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert cfg.cache_config.mamba_cache_mode == "align"
        assert sm.align_block_size(cfg) == jamba.block_size
        return sm.plan_jamba_kv_cache(cfg, 2048)

    bare, ours = plan(None), plan(vh.connector_transfer_config())
    assert bare.num_blocks == ours.num_blocks == 2048
    assert [type(g.kv_cache_spec).__name__ for g in ours.kv_cache_groups] == [
        "MambaSpec",
        "FullAttentionSpec",
    ]
    assert not [m for m in vllm_warnings if hh.TURNING_OFF in m]


def test_state_dtypes_plan_different_block_sizes(jamba_dir: str) -> None:
    # The two dtypes are two geometries: with the CPU probe no longer read, both tests of each
    # pair would silently run one of them.
    planned: dict[str, sm.Planned] = {}
    for dtype in sm.STATE_DTYPES:
        with sm.state_dtype(dtype):
            planned[dtype] = sm.plan(jamba_dir, "jamba", dtype)
    bf16, fp32 = planned["bfloat16"], planned["float32"]
    assert bf16.block_size < fp32.block_size
    assert bf16.page_bytes < fp32.page_bytes


# ----------------------------------------------------------------------------- store / load
def test_jamba_external_hit_restores_exact_state_and_kv(jamba: sm.Planned) -> None:
    e = engine(jamba, HOST)
    bs, n = jamba.block_size, prompt_len(jamba)
    prompt = vh.prompt_tokens(1, n)
    a = e.add(request(jamba, "A", prompt))
    # The step that computes token HIT * bs writes the state vLLM hands off for that boundary.
    e.run_until(computed(a, HIT * bs))
    state_a = hh.group_bits(e, "A", STATE_GROUP, HIT - 1, HIT)
    attn_a = hh.group_bits(e, "A", ATTN_GROUP, 0, HIT)
    e.run()
    assert hh.stat_total(e, "group0_store_blocks") >= 1, "no boundary state was stored"
    e.reset_gpu_prefix_cache()

    e.add(request(jamba, "B", prompt))
    e.run_until(lambda: hh.loaded(e, "B"))
    # Loaded, not yet read: the state block is the one vLLM allocated at the hit's end.
    assert hh.same(hh.group_bits(e, "B", STATE_GROUP, HIT - 1, HIT), state_a)
    assert hh.same(hh.group_bits(e, "B", ATTN_GROUP, 0, HIT), attn_a)
    e.run()
    m = e.workers[0].model
    assert m.written["B"] == n - HIT * bs + 2  # only the tail after the hit
    assert m.checked["B"] >= HIT * bs + 1  # every position, then the state, at the join
    assert hh.stat_total(e, "group0_load_blocks") == 1  # one state block
    assert hh.stat_total(e, "group1_load_blocks") == HIT
    assert e.outputs["A"] == e.outputs["B"]
    assert not e.mismatches()
    assert not any(rec.invalid_block_ids or rec.failed_recving for rec in e.history)
    vh.assert_no_leaks(e)
    e.shutdown()


def test_jamba_hit_needs_a_state_at_its_end(jamba: sm.Planned) -> None:
    # A's attention blocks 0..9 are stored, but vLLM hands off A's state only after block 9
    # (its prompt's checkpoint). B shares A's first 8 blocks: no state exists after block 7,
    # so nothing can resume there and B computes all of it.
    e = engine(jamba, HOST)
    n = prompt_len(jamba)
    prompt = vh.prompt_tokens(2, n)
    e.add(request(jamba, "A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    b_prompt = vh.prompt_tokens(3, n, prefix=prompt[: 8 * jamba.block_size])
    e.add(request(jamba, "B", b_prompt))
    e.run()
    assert not hh.loaded(e, "B")
    assert e.workers[0].model.written["B"] == n + 2
    hh.finish_clean(e)


# ----------------------------------------------------------------------------- SSD
def store_on_ssd(p: sm.Planned, ssd_dir: Path, prompt: list[int]) -> list[int]:
    """An engine computes `prompt` with an SSD tier and shuts down; its request's output."""
    return hh.compute_and_shut_down(engine(p, vh.with_ssd(ssd_dir)), request(p, "A", prompt))


def test_jamba_restart_same_ssd_dir_hits(jamba: sm.Planned, tmp_path: Path) -> None:
    n = prompt_len(jamba)
    prompt = vh.prompt_tokens(4, n)
    outputs = store_on_ssd(jamba, tmp_path / "ssd", prompt)
    e2 = engine(jamba, vh.with_ssd(tmp_path / "ssd"))
    e2.add(request(jamba, "B", prompt))
    e2.run()
    assert hh.loaded(e2, "B")
    assert e2.workers[0].model.written["B"] == n - HIT * jamba.block_size + 2
    assert e2.outputs["B"] == outputs
    hh.finish_clean(e2)


def test_jamba_corrupt_ssd_recomputes_via_failed_recving(jamba: sm.Planned, tmp_path: Path) -> None:
    n = prompt_len(jamba)
    # Recomputed in full.
    hh.assert_corrupt_ssd_recomputes(
        lambda _dir, extra, **kw: engine(jamba, extra, **kw),
        functools.partial(request, jamba),
        jamba.model_dir,
        tmp_path / "ssd",
        vh.prompt_tokens(5, n),
        n + 2,
    )


def test_jamba_kv_events_name_the_state_group(
    jamba: sm.Planned, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")
    e = engine(jamba, HOST)
    a = e.add(request(jamba, "A", vh.prompt_tokens(6, prompt_len(jamba))))
    e.run()
    e.shutdown()
    stored = [ev for ev in e.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    state = [ev for ev in stored if ev.group_idx == STATE_GROUP]
    # One state, the one after block 9 (the prompt's checkpoint), announced under the Mamba group.
    assert [ev.block_hashes for ev in state] == [
        [maybe_convert_block_hash(a.block_hashes[HIT - 1])]
    ]
    assert state[0].kv_cache_spec_kind == "mamba"
    assert sum(len(ev.block_hashes) for ev in stored if ev.group_idx == ATTN_GROUP) == HIT


def test_jamba_tp2_each_rank_restores_its_state_shard(jamba: sm.Planned) -> None:
    e = engine(jamba, HOST, tp_size=2)
    n = prompt_len(jamba)
    prompt = vh.prompt_tokens(7, n)
    e.add(request(jamba, "A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(request(jamba, "B", prompt))
    e.run()
    assert hh.loaded(e, "B")
    for w in e.workers:
        assert w.model.written["B"] == n - HIT * jamba.block_size + 2, (
            f"rank {w.model.rank} recomputed"
        )
    hh.finish_clean(e, "A", "B")


def test_jamba_preemption_keeps_state_correct(jamba: sm.Planned) -> None:
    # 3 requests of 5 blocks that each decode `decode` tokens, in a pool that holds one request
    # of max_model_len (vLLM's planning checks it) but not the three grown ones: decode must
    # preempt.
    pool, decode = 24, 380
    grown = jamba.blocks(5 * jamba.block_size + decode)
    assert 3 * grown > pool, "the scenario cannot preempt at this block size"
    e = engine(jamba, HOST, num_blocks=pool, max_model_len=1024)
    reqs = [
        e.add(
            request(
                jamba, f"P{i}", vh.prompt_tokens(40 + i, 5 * jamba.block_size), max_tokens=decode
            )
        )
        for i in range(3)
    ]
    e.run(timeout_s=300)
    assert any(r.num_preemptions > 0 for r in reqs), "scenario did not preempt"
    assert not e.mismatches()
    assert all(len(e.outputs[r.request_id]) == decode for r in reqs)
    vh.assert_no_leaks(e)
    e.shutdown()


# ----------------------------------------------------------------------------- composition
@pytest.mark.parametrize("wrapper", ["MultiConnector", "PdConnector"])
def test_jamba_hma_declared_inside_wrappers_next_to_nixl(
    jamba: sm.Planned, wrapper: str, vllm_warnings: list[str]
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
    cfg = vh.make_vllm_config(jamba.model_dir, transfer)
    assert cfg.kv_transfer_config is not None
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert not [m for m in vllm_warnings if hh.TURNING_OFF in m]
    assert sm.align_block_size(cfg) == jamba.block_size
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
