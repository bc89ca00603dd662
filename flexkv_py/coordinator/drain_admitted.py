"""With `min_hits` > 1, the keys whose access count reached it, named to the workers: their
shutdown drain writes only those (integration/vllm/shutdown_drain.py), as write-behind and
eviction would."""

from __future__ import annotations

from collections.abc import Iterable

from flexkv_py.index.tier_index import TierIndex

# Admitted keys kept until a step takes them (nobody takes them without vLLM workers).
MAX_NOTED_ADMITTED = 1 << 20


class DrainAdmitted:
    def __init__(self, index: TierIndex, min_hits: int, *, has_spill_tier: bool) -> None:
        self._index = index
        self._need = min_hits
        self._on = min_hits > 1 and has_spill_tier
        self._noted: dict[bytes, None] = {}

    def note(self, keys: Iterable[bytes], *, stored: bool) -> None:
        """`keys` were accessed (`stored`: by a store): note those that reached `min_hits`."""
        if not self._on:
            return
        hits, noted, need = self._index.hits, self._noted, self._need
        for key in keys:
            h = hits(key)
            if h == need or (stored and h > need):
                noted[key] = None
        while len(noted) > MAX_NOTED_ADMITTED:
            del noted[next(iter(noted))]

    def take(self) -> tuple[bytes, ...]:
        """Keys noted since the last call (for the step's metadata)."""
        out = tuple(self._noted)
        self._noted.clear()
        return out
