"""The tier index's second view of its entries: namespace head -> block hash -> Entry.

A logical key is head (namespace prefix + variant) + the engine's block hash. Filing every entry
also under (head, hash) lets a lookup take vLLM's hashes as they are, without building keys.
The values are the same `Entry` objects as the key map: one dict slot and one hash copy per key.
Not locked: the owning `TierIndex` calls it under its lock.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from flexkv_py.index.namespace import PREFIX_LEN, VARIANT_LEN

HEAD_LEN = PREFIX_LEN + VARIANT_LEN

V = TypeVar("V")


class HeadMap(Generic[V]):
    def __init__(self) -> None:
        self.by_head: dict[bytes, dict[bytes, V]] = {}

    def add(self, key: bytes, value: V) -> None:
        if len(key) > HEAD_LEN:
            head = key[:HEAD_LEN]
            sub = self.by_head.get(head)
            if sub is None:
                sub = self.by_head[head] = {}
            sub[key[HEAD_LEN:]] = value

    def remove(self, key: bytes) -> None:
        if len(key) > HEAD_LEN:
            head = key[:HEAD_LEN]
            sub = self.by_head[head]
            del sub[key[HEAD_LEN:]]
            if not sub:
                del self.by_head[head]

    def get(self, head: bytes) -> dict[bytes, V] | None:
        return self.by_head.get(head)
