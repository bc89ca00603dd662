"""One transfer engine for a state-space hybrid (Jamba-shaped, vLLM 0.33's own planning and
allocation on CPU): the Mamba layers are int8 views with a padded block stride over the same
layer slots as the attention layers, so the attention layers' pages carry every state byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import ssm_model as sm
import torch
import vllm_harness as vh
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer import TransferEngine, UnsupportedKVLayoutError
from flexkv_py.transfer.group_layouts import transfer_kv_caches


@pytest.fixture(scope="module")
def jamba(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    d = sm.jamba_model_dir(Path(tmp_path_factory.mktemp("jamba")))
    cfg = vh.make_vllm_config(d, None)
    sm.align_block_size(cfg)
    # vLLM's planning checks one max-length request fits in the 16 blocks of 96 tokens.
    cfg.model_config.max_model_len = cfg.scheduler_config.max_model_len = 1024
    plan = sm.plan_jamba_kv_cache(cfg, 16)
    kv = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout.LBHNC)
    return kv, [list(g.layer_names) for g in plan.kv_cache_groups]


def test_state_layers_ride_in_the_attention_pages(
    jamba: tuple[dict[str, torch.Tensor], list[list[str]]],
) -> None:
    kv, groups = jamba
    moved = transfer_kv_caches(kv, groups, state_groups=[0])
    assert sorted(moved) == sorted(groups[1])  # the attention layers only
    state = [kv[n] for n in groups[0]]
    assert all(t.dtype == torch.int8 for t in state)
    # Round trip: block 3's state (and KV) through a host slot into block 9, bit-exact.
    gen = torch.Generator().manual_seed(1)
    for t in state:
        t[3].copy_(torch.randint(-128, 127, t[3].shape, generator=gen, dtype=torch.int8))
    want = [t[3].clone() for t in state]
    # The state's bytes read as bf16 may be NaN: compare bits.
    attn_want = [kv[n][3].view(torch.int16).clone() for n in groups[1]]
    with (
        HostPool(2, 24576, pin=False) as pool,
        TransferEngine(moved, pool) as engine,
    ):
        engine.submit_d2h([3], [1]).wait(timeout=30)
        for t in kv.values():
            t[9].zero_()
        engine.submit_h2d([1], [9]).wait(timeout=30)
    assert all(torch.equal(t[9], w) for t, w in zip(state, want, strict=True))
    assert all(
        torch.equal(kv[n][9].view(torch.int16), w)
        for n, w in zip(groups[1], attn_want, strict=True)
    )


def test_state_group_outside_the_attention_slots_is_refused(
    jamba: tuple[dict[str, torch.Tensor], list[list[str]]],
) -> None:
    kv, groups = jamba
    own = dict(kv)
    # A state layer in memory of its own: the attention pages would not carry it.
    own[groups[0][0]] = torch.zeros_like(kv[groups[0][0]])
    with pytest.raises(UnsupportedKVLayoutError, match=r"KV cache group 0 \(model.layers.0.mamba"):
        transfer_kv_caches(own, groups, state_groups=[0])


def test_qwen3_next_gated_delta_net_states_share_the_attention_slot(
    tmp_path: Path,
) -> None:
    # Three linear-attention groups and one attention group of one layer each: vLLM lays all
    # four onto one layer slot, so the attention layer's page carries every group's block.
    d = sm.jamba_model_dir(tmp_path, sm.QWEN3NEXT_CONFIG)
    cfg = vh.make_vllm_config(d, None)
    assert sm.align_block_size(cfg) == 64
    cfg.model_config.max_model_len = cfg.scheduler_config.max_model_len = 1024
    plan = sm.plan_jamba_kv_cache(cfg, 32, sm.QWEN3NEXT_LAYER_NAMES)
    kinds = [type(g.kv_cache_spec).__name__ for g in plan.kv_cache_groups]
    assert kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    kv = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout.LBHNC)
    groups = [list(g.layer_names) for g in plan.kv_cache_groups]
    assert list(transfer_kv_caches(kv, groups, state_groups=[0, 1, 2])) == groups[3]
