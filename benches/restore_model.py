"""The model side of `restore_vs_recompute.py`: a Qwen3-8B-shaped decoder with random weights,
its prefill and next-token logits, and the vLLM 0.33-shaped paged cache its KV is written into
(scattered block ids, LBNHC) and read back from."""

from __future__ import annotations

from typing import Any

import torch

from flexkv_py.index.namespace import Namespace

BLOCK = 16  # tokens per vLLM block

# vLLM 0.33 stride order over the logical [L, B, H, N, C] (LBNHC: per layer, block, token, head).
LBNHC_ORDER = (0, 1, 3, 2, 4)

QWEN3_8B: dict[str, Any] = dict(
    num_hidden_layers=36,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    max_position_embeddings=40960,
)
TINY: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=4096,
)


def build_model(quick: bool, device: str) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        **(TINY if quick else QWEN3_8B),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if isinstance(getattr(cfg, "rope_parameters", None), dict):  # transformers >= 5
        cfg.rope_parameters["rope_theta"] = 1000000.0  # Qwen3-8B's
    else:
        cfg.rope_theta = 1000000.0
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
        except TypeError:  # transformers < 4.56
            model = AutoModelForCausalLM.from_config(
                cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
            )
    return model.to(device=device, dtype=torch.bfloat16).eval()


def cache_layers(pkv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [1, kv_heads, tokens, head_dim], from a transformers cache."""
    if hasattr(pkv, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in pkv.layers]
    if hasattr(pkv, "key_cache"):
        return list(zip(pkv.key_cache, pkv.value_cache, strict=True))
    return [(k, v) for k, v in pkv]  # legacy tuple of tuples


def make_dynamic_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@torch.inference_mode()
def prefill(model: Any, ids: torch.Tensor) -> Any:
    return model(input_ids=ids, use_cache=True, logits_to_keep=1)


@torch.inference_mode()
def next_token_logits(
    model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], token: torch.Tensor, math: bool = True
) -> torch.Tensor:
    """Logits of one next token over this KV. Attention runs SDPA's math backend by default: with
    the default (fused) backends, bit-identical KV of 32K tokens gave logits up to 0.14 apart on
    the H200, which would make "exactly equal" meaningless (row: logits_repeatable_fused)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = kv[0][0].shape[2]
    pos = torch.tensor([[p]], device=token.device)
    with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
        out = model(
            input_ids=token,
            past_key_values=make_dynamic_cache(kv),
            position_ids=pos,
            cache_position=pos[0],
            use_cache=True,
        )
    return out.logits[:, -1].float()


# ------------------------------------------------------------------------------------ paged cache
def make_paged_caches(
    layers: int, blocks: int, heads: int, head: int, device: str
) -> dict[str, torch.Tensor]:
    """vLLM 0.33 KV caches: per layer a [B, H, N, 2*D] view of one bf16 buffer, LBNHC order,
    filled with random bits (so unwritten blocks never look restored)."""
    logical = (layers, blocks, heads, BLOCK, 2 * head)
    buf = torch.empty(tuple(logical[d] for d in LBNHC_ORDER), dtype=torch.bfloat16, device=device)
    buf.view(torch.int16).random_(-32768, 32767)
    view5 = buf.permute(*[LBNHC_ORDER.index(d) for d in range(5)])  # logical [L, B, H, N, C]
    return {f"model.layers.{i}.self_attn.attn": view5[i] for i in range(layers)}


def scatter_kv(
    caches: dict[str, torch.Tensor], kv: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int]
) -> None:
    """Write each layer's K, V ([1, H, P, D]) into the paged cache at block ids `ids`."""
    idx = torch.tensor(ids, device=kv[0][0].device)
    for view, (k, v) in zip(caches.values(), kv, strict=True):
        _, h, p, d = k.shape
        pages = torch.cat([k[0], v[0]], dim=-1).reshape(h, p // BLOCK, BLOCK, 2 * d)
        view[idx] = pages.permute(1, 0, 2, 3)


def gather_kv(
    caches: dict[str, torch.Tensor], ids: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [1, H, len(ids)*16, D], read back from the paged cache's blocks `ids`."""
    idx = torch.tensor(ids, device=next(iter(caches.values())).device)
    out = []
    for view in caches.values():
        pages = view[idx]  # [n, H, N, 2D]
        n, h, _, c = pages.shape
        kv = pages.permute(1, 0, 2, 3).reshape(1, h, n * BLOCK, c)
        d = c // 2
        out.append((kv[..., :d].contiguous(), kv[..., d:].contiguous()))
    return out


def blocks_equal(caches: dict[str, torch.Tensor], a: list[int], b: list[int]) -> bool:
    dev = next(iter(caches.values())).device
    ia, ib = torch.tensor(a, device=dev), torch.tensor(b, device=dev)
    return all(torch.equal(v[ia], v[ib]) for v in caches.values())


def kv_equal(
    a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    return all(
        torch.equal(x, y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)
    )


def bench_keys(p: int, n: int, spare: int, page: int, quick: bool = False) -> tuple[Any, ...]:
    """The restore benches' namespace for a P-token prompt (LBNHC pages of `page` bytes), its
    `n` block keys and `spare` keys of other blocks (to fill the host tier before a restore)."""
    ns = Namespace(
        model="bench/tiny-random" if quick else "bench/qwen3-8b-random",
        revision=None,
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=BLOCK,
        page_bytes=page,
    )
    keys = ns.keys([b"p%d-%027x" % (p, i) for i in range(n)])
    warm_keys = ns.keys([b"warm-%d-%d" % (p, i) for i in range(spare)])
    return ns, keys, warm_keys
