"""A Gemma-4-shaped hybrid whose KV cache groups get different block sizes, for the vLLM harness:
4 layers, sliding-window (head_dim 16) at 0 and 2, full attention (global_head_dim 32) at 1 and 3.

A full-attention page is twice a sliding-window page, so vLLM's planning
(`unify_kv_cache_spec_page_size`, kv_cache_planning.py) doubles the sliding-window layers'
block size to even the pages out: full attention 16 tokens per block, sliding window 32. The
engine core then hashes every 16 tokens (`resolve_kv_cache_block_sizes`: the GCD) and schedules
in multiples of 32 (the LCM)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)

from helpers import vllm_harness as vh
from helpers.vllm_versions import kv_cache_groups, plan_kv_cache_configs

WINDOW = 128
LAYERS = 4
GEMMA4_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": vh.NUM_KV_HEADS,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": vh.NUM_KV_HEADS,
    "num_hidden_layers": LAYERS,
    "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
    "sliding_window": WINDOW,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "torch_dtype": "bfloat16",
}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
WINDOWS = [WINDOW if i % 2 == 0 else 0 for i in range(LAYERS)]


def gemma4_model_dir(root: Path) -> str:
    d = root / "tiny-gemma4"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(GEMMA4_CONFIG))
    return str(d)


def layer_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """What each layer's Attention.get_kv_cache_spec returns: its own head_dim and kv heads
    from the config's per-layer view (Gemma4DecoderLayer reads `per_layer_config`)."""
    text = vllm_config.model_config.hf_text_config
    bs = vllm_config.cache_config.block_size
    tp = vllm_config.parallel_config.tensor_parallel_size
    specs: dict[str, KVCacheSpec] = {}
    for i, name in enumerate(LAYER_NAMES):
        layer = text.per_layer_config[i]
        kw = {
            "block_size": bs,
            "num_kv_heads": max(1, layer.num_key_value_heads // tp),
            "head_size": layer.head_dim,
            "dtype": torch.bfloat16,
        }
        if text.layer_types[i] == "sliding_attention":
            specs[name] = SlidingWindowSpec(sliding_window=WINDOW, **kw)
        else:
            specs[name] = FullAttentionSpec(**kw)
    return specs


def plan_kv_cache(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """vLLM's engine-core planning for `num_blocks` blocks (one largest page per layer slot)."""
    specs = layer_specs(vllm_config)
    page = max(s.page_size_bytes for s in specs.values())
    groups = kv_cache_groups(vllm_config, specs)
    memory = num_blocks * page * max(len(g.layer_names) for g in groups)
    return plan_kv_cache_configs(vllm_config, [specs], [memory])[0]


def fake_model(
    rank: int, kv: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig
) -> vh.FakeModel:
    layer_group = {
        LAYER_NAMES.index(name): gid
        for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }
    return vh.FakeModel(
        rank,
        kv,
        list(range(LAYERS)),
        names=tuple(LAYER_NAMES),
        layer_group=layer_group,
        windows=tuple(WINDOWS),
    )
