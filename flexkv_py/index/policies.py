"""Eviction policies (which host-resident block goes first) and the host->SSD admission policy.

Eviction policies only ever see blocks that may be evicted right now (resident and unpinned); the
tier index adds and removes keys as that changes. Every operation is O(1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator

from flexkv_py.config.admission import AdmissionSpec
from flexkv_py.errors import ConfigError


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def add(self, key: Hashable, freq: int = 1) -> None:
        """Make `key` evictable; `freq` is its access count so far (LFU uses it)."""

    def add_oldest(self, key: Hashable, freq: int = 1) -> None:
        """`add`, placed to go before the others of its rank (a chain's parent that became its
        tail when its child was evicted: they were used together, it is next)."""
        self.add(key, freq)

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """`key` was accessed (no-op if absent)."""

    @abstractmethod
    def remove(self, key: Hashable) -> bool:
        """Stop tracking `key`; False if it was not tracked."""

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        """`remove` of each key (a batch of blocks pinned at once)."""
        for key in keys:
            self.remove(key)

    @abstractmethod
    def pop_victim(self) -> Hashable | None:
        """Remove and return the next block to evict, None when nothing is evictable."""

    def newest(self) -> Iterator[Hashable]:
        """The tracked keys, the last to be evicted first (what stays longest); none by default."""
        return iter(())

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class RecencyPolicy(EvictionPolicy):
    """Blocks in order, oldest evicted first: least recently used (`refresh`: an access or a
    re-add moves a block to the newest end) or insertion order (FIFO: accesses do not)."""

    def __init__(self, *, refresh: bool) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._refresh = refresh
        self.name = "lru" if refresh else "fifo"

    def add(self, key: Hashable, freq: int = 1) -> None:
        order = self._order
        if self._refresh:
            order[key] = None
            order.move_to_end(key)
        elif key not in order:  # FIFO: a block that was pinned (untracked) re-enters at the tail
            order[key] = None

    def add_oldest(self, key: Hashable, freq: int = 1) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def touch(self, key: Hashable) -> None:
        if self._refresh and key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> bool:
        return self._order.pop(key, False) is None

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        pop = self._order.pop
        for key in keys:  # no Python call per key
            pop(key, None)

    def pop_victim(self) -> Hashable | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def newest(self) -> Iterator[Hashable]:
        return reversed(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


def LRUPolicy() -> RecencyPolicy:
    """Least recently used: an access or a re-add refreshes a block."""
    return RecencyPolicy(refresh=True)


def FIFOPolicy() -> RecencyPolicy:
    """Insertion order; accesses do not refresh a block."""
    return RecencyPolicy(refresh=False)


class LFUPolicy(EvictionPolicy):
    """Least frequently used, ties broken by least recently used.

    Counts saturate at MAX_FREQ so finding the lowest non-empty bucket is bounded (O(1)) and a
    block that was hot long ago cannot stay forever.
    """

    name = "lfu"
    MAX_FREQ = 32

    def __init__(self) -> None:
        self._freq: dict[Hashable, int] = {}
        self._buckets: list[OrderedDict[Hashable, None]] = [
            OrderedDict() for _ in range(self.MAX_FREQ + 1)
        ]

    def add(self, key: Hashable, freq: int = 1) -> None:
        self.remove(key)
        f = max(1, min(freq, self.MAX_FREQ))
        self._freq[key] = f
        self._buckets[f][key] = None

    def add_oldest(self, key: Hashable, freq: int = 1) -> None:
        self.add(key, freq)
        self._buckets[self._freq[key]].move_to_end(key, last=False)

    def touch(self, key: Hashable) -> None:
        f = self._freq.get(key)
        if f is None or f == self.MAX_FREQ:
            if f is not None:
                self._buckets[f].move_to_end(key)
            return
        del self._buckets[f][key]
        self._freq[key] = f + 1
        self._buckets[f + 1][key] = None

    def remove(self, key: Hashable) -> bool:
        f = self._freq.pop(key, None)
        if f is None:
            return False
        del self._buckets[f][key]
        return True

    def pop_victim(self) -> Hashable | None:
        if not self._freq:
            return None
        for bucket in self._buckets:
            if bucket:
                key, _ = bucket.popitem(last=False)
                del self._freq[key]
                return key
        raise AssertionError("LFU buckets out of sync")  # unreachable

    def newest(self) -> Iterator[Hashable]:
        for bucket in reversed(self._buckets):
            yield from reversed(bucket)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
}


def make_eviction_policy(name: str) -> EvictionPolicy:
    cls = EVICTION_POLICIES.get(name.lower())
    if cls is None:
        raise ConfigError(
            f"eviction_policy: unknown policy {name!r}; "
            f"expected one of {', '.join(EVICTION_POLICIES)}"
        )
    return cls()


class AdmissionPolicy:
    """Decides whether a host block gets a copy on SSD, from its access count (`hits`)."""

    def __init__(self, spec: AdmissionSpec | None = None) -> None:
        self.spec = spec or AdmissionSpec()

    @property
    def write_through(self) -> bool:
        return self.spec.mode == "write_through"

    def admit_on_store(self, hits: int) -> bool:
        """Copy to SSD right after the block lands in host?"""
        return self.write_through and hits >= self.spec.min_hits

    def admit_on_evict(self, hits: int) -> bool:
        """Copy to SSD when the block leaves host (it has no SSD copy yet)?"""
        return hits >= self.spec.min_hits

    def __repr__(self) -> str:
        return f"AdmissionPolicy({self.spec})"
