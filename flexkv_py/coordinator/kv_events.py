"""The manager's KV events (vLLM BlockStored / BlockRemoved for Dynamo's router), queued per
batch: a store announces its blocks as one entry (kind, keys, medium), made into `KVEvent`
objects only when a step takes them (`take`), off the store's path. At most `maxlen` events are
held; the oldest go first, as from a bounded deque."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from flexkv_py.index.namespace import PREFIX_LEN, VARIANT_LEN, Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.registry import MEDIUM as TIER_MEDIUM

Medium = str  # "CPU" (host memory), or a lower tier's (tiers/registry.py MEDIUM: "SSD", "OBJECT")
Kind = Literal["stored", "removed"]
_HASH_AT = PREFIX_LEN + VARIANT_LEN  # a key's engine block hash starts here (Namespace.block_hash)
# The medium each tier's KV events name ("CPU" for host memory), from the tier registry.
MEDIUM: dict[Tier, Medium] = TIER_MEDIUM


@dataclass(frozen=True)
class KVEvent:
    """A block appeared in / left a tier (vLLM BlockStored / BlockRemoved for Dynamo's router)."""

    kind: Kind
    block_hash: bytes
    medium: Medium
    # The key's namespace prefix: which KV cache group of a hybrid model the block is of.
    group_prefix: bytes = field(default=b"", compare=False)


class EventQueue:
    """Not locked: the manager calls it under its own lock."""

    def __init__(self, namespace: Namespace, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"max_events must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._namespace = namespace
        self._batches: deque[tuple[Kind, Sequence[bytes], Medium]] = deque()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, kind: Kind, keys: Sequence[bytes], tier: Tier) -> None:
        """Queue one event per key; ValueError (nothing queued) for a key of another
        namespace, checked now so that the caller that made it sees the error."""
        medium = MEDIUM.get(tier)
        if medium is None or not keys:
            return
        ns = self._namespace
        if min(map(len, keys)) <= _HASH_AT or not ({k[:PREFIX_LEN] for k in keys} <= ns.prefixes):
            raise ValueError("key does not belong to this namespace")
        self._batches.append((kind, tuple(keys), medium))
        self._count += len(keys)
        while self._count > self.maxlen:  # drop the oldest, as deque(maxlen=...) would
            old_kind, old_keys, medium = self._batches[0]
            over = self._count - self.maxlen
            if len(old_keys) <= over:
                self._batches.popleft()
                self._count -= len(old_keys)
            else:
                self._batches[0] = (old_kind, old_keys[over:], medium)
                self._count -= over

    def take(self) -> list[KVEvent]:
        """Every queued event, oldest first; the queue is empty after."""
        out: list[KVEvent] = []
        append, new, at = out.append, object.__new__, _HASH_AT
        for kind, keys, medium in self._batches:
            for key in keys:
                # The frozen dataclass's __init__ (one object.__setattr__ per field) costs
                # ~1.5 us: the fields go into the new event's __dict__ at once, the same
                # object __init__ would build.
                event = new(KVEvent)
                event.__dict__.update(
                    kind=kind, block_hash=key[at:], medium=medium, group_prefix=key[:PREFIX_LEN]
                )
                append(event)
        self._batches.clear()
        self._count = 0
        return out
