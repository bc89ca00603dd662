"""A cap on the object tier's presence hints: the blocks this rank's index marks present on
`Tier.OBJECT` (learned from a lookup of the bucket, or from a write there).

A hint only saves asking the bucket again (the bucket is shared and collected by others, so a
hint may be stale anyway and a load that finds the object gone recomputes it). Without a cap a
long-running worker would remember every block it ever saw in the bucket. Here each learned
key is remembered in the order it was last learned; past `cap` the oldest eighth is forgotten
at once (one scan of the dict's oldest entries per batch, not one per key), and the caller
clears those keys' bits in the index. The block stays in the bucket: a later lookup finds it.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexkv_py.errors import ConfigError

DEFAULT_CAP = 1 << 20


class ObjectHints:
    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        if cap < 0:
            raise ConfigError(f"object_store_hint_cap: must be >= 0, got {cap}")
        self.cap = cap
        self._keys: dict[bytes, None] = {}  # oldest first (insertion order)
        self.forgotten = 0  # hints dropped for the cap so far

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def learned(self, keys: Iterable[bytes]) -> list[bytes]:
        """`keys` were just marked present (newest now); returns the keys to forget (their
        index bits are the caller's to clear), oldest first."""
        hints = self._keys
        for key in keys:
            hints.pop(key, None)
            hints[key] = None
        over = len(hints) - self.cap
        if over <= 0:
            return []
        # Forget at least an eighth of the cap at once: the scan from the dict's start is
        # paid per batch.
        n = min(len(hints), max(over, self.cap // 8))
        it = iter(hints)
        victims = [next(it) for _ in range(n)]
        for key in victims:
            del hints[key]
        self.forgotten += len(victims)
        return victims

    def forget(self, keys: Iterable[bytes]) -> None:
        """The index cleared these keys' bits itself (a failed load, a reset)."""
        for key in keys:
            self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()
