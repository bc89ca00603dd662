"""One transfer engine for a state-space hybrid (Jamba-shaped, vLLM 0.33's own planning and
allocation on CPU): the Mamba layers are int8 views with a padded block stride over the same
layer slots as the attention layers, so the attention layers' pages carry every state byte. Each
test runs with bfloat16 and float32 states (their block and page sizes differ)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import ssm_model as sm
from helpers import vllm_harness as vh
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer import TransferEngine, UnsupportedKVLayoutError
from flexkv_py.transfer.group_layouts import transfer_kv_caches
from flexkv_py.transfer.kv_layout import describe_kv_caches

MAX_LEN = 1024


@dataclass(frozen=True)
class Allocated:
    """vLLM's KV cache tensors for the model, by its plan."""

    kv: dict[str, torch.Tensor]
    groups: list[list[str]]
    kinds: list[str]  # each group's spec class
    page_bytes: int  # one layer slot's page per block (attention's; each state padded to it)


def allocate(model_dir: str, names: list[str]) -> Allocated:
    cfg = vh.make_vllm_config(model_dir, None)
    block_size = sm.align_block_size(cfg)
    # vLLM's planning checks one max-length request fits: room for two.
    cfg.model_config.max_model_len = cfg.scheduler_config.max_model_len = MAX_LEN
    plan = sm.plan_jamba_kv_cache(cfg, -(-2 * MAX_LEN // block_size), names)
    pages = {g.kv_cache_spec.page_size_bytes for g in plan.kv_cache_groups}
    assert len(pages) == 1, f"groups' pages differ: {pages}"  # so they share the layer slots
    kv = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout.LBHNC)
    groups = plan.kv_cache_groups
    return Allocated(
        kv,
        [list(g.layer_names) for g in groups],
        [type(g.kv_cache_spec).__name__ for g in groups],
        pages.pop(),
    )


@pytest.fixture(scope="module", params=sm.STATE_DTYPES)
def jamba(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Allocated:
    d = sm.jamba_model_dir(Path(tmp_path_factory.mktemp("jamba")))
    # Only the planning reads the dtype: the tensors outlive the faked CPU probe.
    with sm.state_dtype(request.param):
        sm.plan(d, "jamba", request.param)  # vLLM keeps the states in that dtype
        return allocate(d, sm.JAMBA_LAYER_NAMES)


def test_state_layers_ride_in_the_attention_pages(jamba: Allocated) -> None:
    kv, groups = jamba.kv, jamba.groups
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
    # A host slot holds a block of every attention layer: the same bytes as vLLM's page.
    with (
        HostPool(2, jamba.page_bytes * len(moved), pin=False) as pool,
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


def test_state_group_outside_the_attention_slots_is_refused(jamba: Allocated) -> None:
    kv, groups = jamba.kv, jamba.groups
    own = dict(kv)
    # A state layer in memory of its own: the attention pages would not carry it.
    own[groups[0][0]] = torch.zeros_like(kv[groups[0][0]])
    with pytest.raises(UnsupportedKVLayoutError, match=r"KV cache group 0 \(model.layers.0.mamba"):
        transfer_kv_caches(own, groups, state_groups=[0])


def test_qwen3_next_gated_delta_net_states_share_the_attention_slot(
    tmp_path: Path, ssm_state_dtype: str
) -> None:
    # Three linear-attention groups and one attention group of one layer each: vLLM lays all
    # four onto one layer slot, so the attention layer's page carries every group's block.
    d = sm.jamba_model_dir(tmp_path, sm.QWEN3NEXT_CONFIG)
    sm.plan(d, "qwen3next", ssm_state_dtype)  # vLLM keeps the states in that dtype
    got = allocate(d, sm.QWEN3NEXT_LAYER_NAMES)
    assert got.kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    moved = transfer_kv_caches(got.kv, got.groups, state_groups=[0, 1, 2])
    assert list(moved) == got.groups[3]
    # One layer's page per block moves every group's block.
    assert describe_kv_caches(moved).page_nbytes == got.page_bytes
