"""The model shape a replay simulates: it fixes the KV bytes per token and per block."""

from __future__ import annotations

from dataclasses import dataclass

from flexkv_py.errors import ConfigError

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
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}"
            )
