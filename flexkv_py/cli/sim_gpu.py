"""A stand-in for the GPU during replay: a KV cache shaped like vLLM 0.33's (one backing buffer,
per-layer ``[B, H, N, C]`` views in the default LBNHC physical order) on CPU, with a bounded
prefix cache (LRU of blocks) in front of the offload tiers, and deterministic KV contents so
every block that comes back from a tier can be checked bit for bit.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from flexkv_py.cli.model_shape import ModelShape
from flexkv_py.errors import InternalStateError


class SimulatedGPU:
    """`num_blocks` KV blocks of `block_tokens` tokens plus an LRU prefix cache over them."""

    def __init__(self, shape: ModelShape, num_blocks: int, block_tokens: int) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        c = 2 * shape.head_dim  # K and V concatenated on the last dim
        # Physical LBNHC; each layer's view is [B, H, N, C] like vLLM's.
        dtype: torch.dtype = getattr(torch, shape.dtype)
        self.buffer = torch.zeros(
            (shape.layers, num_blocks, block_tokens, shape.kv_heads, c), dtype=dtype
        )
        self.kv_caches = {
            f"model.layers.{i}.self_attn.attn": self.buffer[i].permute(0, 2, 1, 3)
            for i in range(shape.layers)
        }
        # The same memory as int16 words: [L, B, N, H, words]; block b is words[:, b].
        self._words = self.buffer.view(torch.int16)
        self._block_shape = self._words[:, 0].shape
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # key -> block, LRU first
        self._free = list(range(num_blocks - 1, -1, -1))

    # ------------------------------------------------------------------ contents
    def expected(self, content: bytes) -> np.ndarray:
        """The KV bytes (as int16 words) a block with this content always has."""
        seed = int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "little")
        words = self._block_shape.numel()
        rng = np.random.default_rng(seed)
        return rng.integers(-(1 << 15), 1 << 15, words, dtype=np.int16)

    def compute(self, blocks: Sequence[int], contents: Sequence[bytes]) -> None:
        """'Prefill': write each block's deterministic KV (all layers, K and V)."""
        for block, content in zip(blocks, contents, strict=True):
            page = torch.from_numpy(self.expected(content)).view(self._block_shape)
            self._words[:, block] = page

    def mismatches(self, blocks: Sequence[int], contents: Sequence[bytes]) -> int:
        """Blocks whose bytes differ from what their content implies."""
        return sum(
            not np.array_equal(self._words[:, b].reshape(-1).numpy(), self.expected(c))
            for b, c in zip(blocks, contents, strict=True)
        )

    def poison(self, blocks: Sequence[int]) -> None:
        """Overwrite blocks about to be loaded, so a load that writes nothing cannot pass."""
        if blocks:
            self._words[:, list(blocks)] = 0x5A5A

    # ------------------------------------------------------------------ prefix cache
    def prefix_hits(self, keys: Sequence[bytes]) -> list[int]:
        """GPU blocks of the leading cached keys (marked recently used)."""
        out: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            self._cached.move_to_end(key)
            out.append(block)
        return out

    def allocate(self, n: int, keep: Sequence[bytes]) -> list[int]:
        """n free blocks, evicting least recently used cached blocks not in `keep`."""
        protected = set(keep)
        victims = iter([k for k in self._cached if k not in protected])
        while len(self._free) < n:
            victim = next(victims, None)
            if victim is None:
                # TierSizes.resolve sizes the GPU for the longest request: not reached.
                raise InternalStateError(
                    f"GPU cache of {self.num_blocks} blocks cannot hold {n} more"
                )
            self._free.append(self._cached.pop(victim))
        return [self._free.pop() for _ in range(n)]

    def insert(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        for key, block in zip(keys, blocks, strict=True):
            old = self._cached.pop(key, None)
            if old is not None and old != block:
                self._free.append(old)
            self._cached[key] = block
