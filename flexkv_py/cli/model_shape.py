"""The model shape a replay simulates: it fixes the KV bytes per token and per block."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    layers: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float16"  # a torch dtype name

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer (one TP rank)."""
        return self.layers * self.kv_heads * 2 * self.head_dim * DTYPE_BYTES[self.dtype]
