"""What a replayed request is: the cache keys of its prompt's full blocks, and what their KV
bytes derive from."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from flexkv_py.errors import ConfigError

HASH_BYTES = 16


def chain_hashes(parts: Iterable[bytes], seed: bytes = b"") -> list[bytes]:
    """vLLM-style prefix hashes: block i's hash covers blocks 0..i (and the seed, e.g. a salt)."""
    out: list[bytes] = []
    parent = hashlib.blake2b(seed, digest_size=HASH_BYTES).digest()
    for part in parts:
        parent = hashlib.blake2b(parent + part, digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the start of the workload
    keys: tuple[bytes, ...]  # block hashes of the prompt's full blocks (the cache keys)
    # What each block's KV bytes derive from. Equal to `keys` unless a cache salt separates
    # tenants that share content: then equal contents under different keys (SSD dedup).
    contents: tuple[bytes, ...]
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.contents):
            raise ConfigError("keys and contents must have one entry per block")


@dataclass
class Workload:
    name: str
    block_tokens: int  # tokens per cache block
    requests: list[Request]
    params: dict[str, object] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(r.keys) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        return len({k for r in self.requests for k in r.keys})

    @property
    def max_request_blocks(self) -> int:
        return max((len(r.keys) for r in self.requests), default=0)
