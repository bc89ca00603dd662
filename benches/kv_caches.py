"""KV caches shaped as vLLM 0.33 registers them (legacy FlashAttention or one buffer per
stride order), filled with random bytes: the GPU side of the transfer and tier benches."""

from __future__ import annotations

import torch

LAYOUT_ORDER = {  # vLLM 0.33 stride orders over logical [L, B, H, N, C]
    "LBNHC": (0, 1, 3, 2, 4),
    "BLNHC": (1, 0, 3, 2, 4),
}


def make_caches(
    layout: str, layers: int, blocks: int, heads: int, head: int, tokens: int, device: str
) -> dict[str, torch.Tensor]:
    """KV caches shaped as vLLM registers them, filled with random bytes."""
    dtype = torch.bfloat16
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    if layout == "FA":
        caches = {
            n: torch.empty((2, blocks, tokens, heads, head), dtype=dtype, device=device)
            for n in names
        }
    else:
        order = LAYOUT_ORDER[layout]
        logical = (layers, blocks, heads, tokens, 2 * head)
        physical = tuple(logical[d] for d in order)
        buf = torch.empty(physical, dtype=dtype, device=device)
        inverse = [order.index(d) for d in range(5)]
        view5 = buf.permute(*inverse)  # logical [L, B, H, N, C]
        caches = {n: view5[i] for i, n in enumerate(names)}
    for t in caches.values():
        t.view(torch.int16).random_(-32768, 32767)
    return caches
