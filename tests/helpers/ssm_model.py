"""A Jamba-shaped state-space hybrid for the vLLM harness: 4 layers, attention at 1 and 3, Mamba-1
at 0 and 2, planned by vLLM 0.33's own code on CPU (`config.json` only, no weights).

vLLM's path: `VllmConfig` post-init turns Mamba prefix caching to "align" mode, the executor's
`update_block_size_for_backend` raises the block size until an attention page holds a (padded)
Mamba page (16 -> 64 with bfloat16 states, 96 with float32 ones: `state_dtype`), each layer's
spec is what `Attention.get_kv_cache_spec` / `MambaBase.get_kv_cache_spec` return (state shapes
from the model class), and `get_kv_cache_configs` groups and sizes them. The one stub: the
platform finds the attention backends by walking instantiated layers, which a config-only model
has none of.

`StateModel` extends the harness's FakeModel: besides per-position attention KV it keeps, per
Mamba layer, a "state" that is a deterministic function of the whole token prefix, written into
the block holding the state after the step's last token (vLLM's align mode: table index
cdiv(end, block_size) - 1) and checked where a joining request reads it (the block ending at its
first computed token), so a missing, stale or foreign state is caught when vLLM would read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec

from helpers import vllm_harness as vh
from helpers.vllm_versions import kv_cache_groups, plan_kv_cache_configs

JAMBA_CONFIG = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": vh.NUM_KV_HEADS,
    "num_hidden_layers": 4,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 8,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "use_mamba_kernels": False,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
# Qwen3-Next shape: gated delta-net (linear attention) at 0-2, full attention at 3.
QWEN3NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": vh.NUM_KV_HEADS,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "partial_rotary_factor": 0.25,
    "torch_dtype": "bfloat16",
}
QWEN3NEXT_LAYER_NAMES = [
    *(f"model.layers.{i}.linear_attn" for i in range(3)),
    "model.layers.3.self_attn.attn",
]
JAMBA_LAYERS = 4
# Attention at odd layers (attn_layer_period 2, offset 1), Mamba-1 at even ones.
JAMBA_LAYER_NAMES = [
    f"model.layers.{i}.self_attn.attn" if i % 2 else f"model.layers.{i}.mamba"
    for i in range(JAMBA_LAYERS)
]
STATE_LAYERS = [i for i in range(JAMBA_LAYERS) if i % 2 == 0]
ATTENTION_LAYERS = [i for i in range(JAMBA_LAYERS) if i % 2]
HEAD_SIZE = 64 // 4  # hidden_size / num_attention_heads


def jamba_model_dir(root: Path, config: dict[str, Any] = JAMBA_CONFIG) -> str:
    d = root / f"tiny-{config['model_type']}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


# The SSM state dtypes a test runs with: bfloat16 (the model's, what a GPU keeps) and float32.
STATE_DTYPES = ("bfloat16", "float32")
_CONV_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"


@contextmanager
def state_dtype(dtype: str) -> Iterator[None]:
    """SSM states in `dtype` for the VllmConfigs made inside, on any CPU.

    vLLM's CPU platform (`check_and_update_config`, run by every VllmConfig) resets the state
    dtype to float32 where `torch.cpu._is_avx512_bf16_supported()` and keeps the model's
    bfloat16 elsewhere; the two plan different block and page sizes. The probe is faked so both
    run everywhere (`plan` checks vLLM still reads it)."""
    if dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {dtype!r} is not one of {STATE_DTYPES}")
    # Seeing the feature, vLLM also exports its conv-state layout: keep that inside too.
    layout = os.environ.get(_CONV_LAYOUT_ENV)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: dtype == "float32")
        try:
            yield
        finally:
            if layout is None:
                os.environ.pop(_CONV_LAYOUT_ENV, None)
            else:
                os.environ[_CONV_LAYOUT_ENV] = layout


@dataclass(frozen=True)
class Planned:
    """What vLLM plans for a state-space hybrid: the numbers tests derive their sizes from."""

    model_dir: str
    block_size: int  # raised by vLLM until an attention page holds a state page
    state_dtype: torch.dtype  # the SSM (temporal) state's
    page_bytes: int  # one layer slot's page per block (the state's is padded to it)

    def blocks(self, tokens: int) -> int:
        """Blocks of this size that hold `tokens` tokens (a pool of that many tokens)."""
        return -(-tokens // self.block_size)


def plan(model_dir: str, model: str, dtype: str) -> Planned:
    """vLLM's plan for `model` ("jamba" / "qwen3next") under `state_dtype(dtype)` (entered by
    the caller); fails if vLLM did not keep the states in `dtype`."""
    cfg = vh.make_vllm_config(model_dir, None)
    block_size = align_block_size(cfg)
    specs = jamba_layer_specs(cfg, layer_names(model))
    state = next(s for s in specs.values() if isinstance(s, MambaSpec))
    attention = next(s for s in specs.values() if isinstance(s, FullAttentionSpec))
    got = state.dtypes[-1]
    assert got == getattr(torch, dtype), f"vLLM kept {model}'s SSM state in {got}, not {dtype}"
    assert state.page_size_bytes == attention.page_size_bytes  # padded to the same slot
    return Planned(model_dir, block_size, got, attention.page_size_bytes)


def align_block_size(vllm_config: VllmConfig) -> int:
    """The executor's `update_block_size_for_backend` (uniproc_executor.py), which for a Mamba
    hybrid raises the block size to fit the state page; returns the block size."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cls = type(current_platform)
    saved = cls.__dict__.get("_find_non_ssm_backends")
    # A config-only model has no layers to walk: every attention layer gets the CPU backend.
    cls._find_non_ssm_backends = classmethod(lambda c, vc: [CPUAttentionBackend])  # type: ignore[attr-defined]
    try:
        current_platform.update_block_size_for_backend(vllm_config)
    finally:
        if saved is None:
            del cls._find_non_ssm_backends  # type: ignore[attr-defined]
        else:
            cls._find_non_ssm_backends = saved  # type: ignore[attr-defined]
    return int(vllm_config.cache_config.block_size)


def jamba_layer_specs(
    vllm_config: VllmConfig, names: Sequence[str] = JAMBA_LAYER_NAMES
) -> dict[str, KVCacheSpec]:
    """Attention layers (`...self_attn.attn`) and state layers (the rest) as the model's own
    layers describe them; `names`: Jamba's, or QWEN3NEXT_LAYER_NAMES."""
    cc = vllm_config.cache_config
    heads = vh.NUM_KV_HEADS // vllm_config.parallel_config.tensor_parallel_size
    model_cls, _ = ModelRegistry.resolve_model_cls(
        vllm_config.model_config.architecture, model_config=vllm_config.model_config
    )
    specs: dict[str, KVCacheSpec] = {}
    mamba_type = (
        "mamba1" if "jamba" in vllm_config.model_config.architecture.lower() else "gdn_attention"
    )
    for name in names:
        if name.endswith("self_attn.attn"):
            specs[name] = FullAttentionSpec(
                block_size=cc.block_size,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=torch.bfloat16,
            )
        else:
            specs[name] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                block_size=cc.mamba_block_size,
                page_size_padded=cc.mamba_page_size_padded,
                mamba_type=mamba_type,
                mamba_cache_mode=cc.mamba_cache_mode,
            )
    return specs


def plan_jamba_kv_cache(
    vllm_config: VllmConfig, num_blocks: int, names: Sequence[str] = JAMBA_LAYER_NAMES
) -> KVCacheConfig:
    """vLLM's plan for `num_blocks` blocks: one page per layer slot (the largest group's layer
    count) per block."""
    specs = jamba_layer_specs(vllm_config, names)
    page = next(s for n, s in specs.items() if n.endswith("self_attn.attn")).page_size_bytes
    groups = kv_cache_groups(vllm_config, specs)
    memory = num_blocks * page * max(len(g.layer_names) for g in groups)
    return plan_kv_cache_configs(vllm_config, [specs], [memory])[0]


def _digest(tokens: Sequence[int]) -> int:
    return vh._prefix_digests(tokens)[-1] if tokens else 0


@dataclass
class StateModel(vh.FakeModel):
    """FakeModel's attention KV on the attention layers, plus one state per Mamba layer."""

    state_layers: list[int] = field(default_factory=list)
    block_size: int = 0

    def state(self, layer: int, digest: int) -> torch.Tensor:
        n = self.kv_caches[self.names[layer]][0].numel()
        seed = digest ^ (layer * 0x9E3779B1) ^ (self.rank * 0x85EBCA77)
        vals = (torch.arange(n, dtype=torch.int64) * 2654435761 + seed) % 251 - 125
        return vals.to(torch.int8).reshape(self.kv_caches[self.names[layer]][0].shape)

    def _state_block(self, layer: int, tables: Sequence[Sequence[int]], tokens: int) -> int:
        return tables[self.layer_group[layer]][-(-tokens // self.block_size) - 1]

    def check(self, req_id: str, tokens: Sequence[int], *args: Any, **kw: Any) -> None:
        """FakeModel.check, then the state a request joining at `upto` resumes from."""
        super().check(req_id, tokens, *args, **kw)
        upto, tables = args[1], kw.get("tables")
        if upto == 0 or tables is None:
            return
        digest = _digest(tokens[:upto])
        for layer in self.state_layers:
            block = self._state_block(layer, tables, upto)
            got = self.kv_caches[self.names[layer]][block]
            if block == 0 or not torch.equal(got, self.state(layer, digest)):
                self.mismatches.append(
                    f"{req_id} state at {upto} layer {layer} block {block} rank {self.rank}"
                )
                return
        self.checked[req_id] = self.checked.get(req_id, 0) + 1

    def write(self, req_id: str, tokens: Sequence[int], *args: Any, **kw: Any) -> None:
        """FakeModel.write, then the state after the step's last token (`end`)."""
        super().write(req_id, tokens, *args, **kw)
        end, tables = args[2], kw.get("tables")
        assert tables is not None
        digest = _digest(tokens[:end])
        for layer in self.state_layers:
            block = self._state_block(layer, tables, end)
            assert block, f"{req_id}: no state block for {end} tokens"
            self.kv_caches[self.names[layer]][block].copy_(self.state(layer, digest))

    def block_bits(self, block_id: int, group: int | None = None) -> list[torch.Tensor]:
        out = super().block_bits(block_id, group)
        out.extend(
            self.kv_caches[self.names[i]][block_id].clone()
            for i in self.state_layers
            if group is None or self.layer_group[i] == group
        )
        return out

    def _block_size(self) -> int:
        return self.block_size


def layer_names(model: str) -> list[str]:
    """The layer names of the harness's "jamba" or "qwen3next" model."""
    return {"jamba": JAMBA_LAYER_NAMES, "qwen3next": QWEN3NEXT_LAYER_NAMES}[model]


def state_model(
    rank: int,
    kv: dict[str, Any],
    kv_cache_config: KVCacheConfig,
    names: Sequence[str] = JAMBA_LAYER_NAMES,
) -> StateModel:
    layer_group = {
        names.index(name): gid
        for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }
    attention = [i for i, n in enumerate(names) if n.endswith("self_attn.attn")]
    return StateModel(
        rank,
        kv,
        attention,
        names=tuple(names),
        layer_group=layer_group,
        state_layers=[i for i in range(len(names)) if i not in attention],
        block_size=int(kv_cache_config.kv_cache_groups[-1].kv_cache_spec.block_size),
    )
