"""One key's record in the tier index, and the small values the index hands out.

A key's lower-tier state (the tiers below the host tier: SSD, object store) is two bitmasks over
`LOWER_TIERS`, not one field per tier: `lower` (a confirmed copy is there) and `pending` (a write
there is in flight). A new tier is a new bit; no state, query or transition names a tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from flexkv_py.errors import InternalStateError
from flexkv_py.index.tier_names import TIER_BIT, Tier

__all__ = ["TIER_BIT", "Entry", "IndexStateError", "Located", "Victim", "fastest_of", "tiers_of"]


def tiers_of(mask: int) -> frozenset[Tier]:
    """The lower tiers whose bits are set in `mask`."""
    return frozenset(t for t, bit in TIER_BIT.items() if mask & bit)


def fastest_of(mask: int) -> Tier | None:
    """The fastest lower tier set in `mask` (None if none is)."""
    for tier, bit in TIER_BIT.items():
        if mask & bit:
            return tier
    return None


class IndexStateError(InternalStateError):
    """A state transition that the index does not allow (a bug in the caller)."""


@dataclass(slots=True)
class Entry:
    host_slot: int | None = None
    host_ready: bool = False
    evicting: bool = False
    releasing: bool = False  # host copy evicted while pinned: slot freed by the last unpin
    lower: int = 0  # TIER_BIT mask: confirmed copies below the host tier
    pending: int = 0  # TIER_BIT mask: writes in flight to those tiers
    pins: int = 0
    hits: int = 0
    stale: bool = False  # dropped by reset() while in use: never readable again
    parent: bytes | None = None  # while the host copy is held: the chain parent counting it
    up: bytes | None = None  # name (key_digest) of the chain parent this block is counted against

    @property
    def host_readable(self) -> bool:
        return self.host_ready and not self.stale

    @property
    def readable(self) -> bool:
        return not self.stale and (self.host_ready or self.lower != 0)

    @property
    def evictable(self) -> bool:
        return self.host_ready and not self.evicting and self.pins == 0 and not self.stale

    @property
    def empty(self) -> bool:
        return self.host_slot is None and not (self.lower or self.pending)

    @property
    def lower_tiers(self) -> frozenset[Tier]:
        return tiers_of(self.lower)

    @property
    def pending_tiers(self) -> frozenset[Tier]:
        return tiers_of(self.pending)

    def on(self, tier: Tier) -> bool:
        """A confirmed copy on lower tier `tier` (stale or not)."""
        return bool(self.lower & TIER_BIT[tier])

    def best_tier(self) -> Tier | None:
        if self.stale:
            return None
        if self.host_ready:
            return Tier.HOST
        return fastest_of(self.lower) if self.lower else None


class Located(NamedTuple):
    # A tuple, not a dataclass: one is made per loaded block on the scheduler's hot path.
    tier: Tier
    host_slot: int | None  # set when tier is HOST


@dataclass(frozen=True)
class Victim:
    key: bytes
    host_slot: int
    hits: int
    lower: frozenset[Tier]  # lower tiers that already hold a confirmed copy
