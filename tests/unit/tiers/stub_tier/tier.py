"""The stub tier's `LowerTier`: blocks kept in a dict, copied from and to host slots."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.node.shards import FinishedBatch, MadeResult
from flexkv_py.tiers.protocol import Item


class DictTier:
    def __init__(self, name: Tier) -> None:
        self._name = name
        self.blocks: dict[bytes, bytes] = {}
        self.deleted = 0
        self.closed = False

    @property
    def name(self) -> Tier:
        return self._name

    def submit_put(self, items: Iterable[Item]) -> FinishedBatch:
        out = []
        for key, (addr, n) in items:
            self.blocks[key] = ctypes.string_at(addr, n)
            out.append(MadeResult("ok", n))
        return FinishedBatch(out)

    def submit_get(self, items: Iterable[Item]) -> FinishedBatch:
        out = []
        for key, (addr, n) in items:
            data = self.blocks.get(key)
            if data is None:
                out.append(MadeResult("not_found"))
                continue
            ctypes.memmove(addr, data, min(n, len(data)))
            out.append(MadeResult("ok", len(data)))
        return FinishedBatch(out)

    def delete(self, keys: Iterable[bytes]) -> int:
        n = sum(self.blocks.pop(k, None) is not None for k in keys)
        self.deleted += n
        return n

    def contains(self, key: bytes) -> bool:
        return key in self.blocks

    def drain_evicted(self) -> list[bytes]:
        return []  # the index decides this tier's evictions (its capacity is authoritative)

    def keys(self) -> list[bytes]:
        return list(self.blocks)

    def stats(self) -> dict[str, int | float | str]:
        return {"blocks": len(self.blocks), "deleted": self.deleted}

    def close(self) -> None:
        self.closed = True
