"""A lower-tier read that failed because the copy is gone or bad: the index forgets the copy."""

from __future__ import annotations

from collections import Counter

from flexkv_py.coordinator.jobs import CORRUPT, IO_ERROR, IO_TIMEOUT, NOT_FOUND
from flexkv_py.coordinator.kv_events import EventQueue
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier

# A timed-out read (a stuck device, see late_io.py) counts as lost too: kept, every lookup would
# promise it again and every retry fail at once on fenced slots, a loop of load errors;
# forgotten, the block is recomputed and stored again.
COPY_LOST = frozenset({NOT_FOUND, CORRUPT, IO_ERROR, IO_TIMEOUT})


def forget_lost_copy(
    index: TierIndex,
    events: EventQueue,
    stats: Counter[str],
    key: bytes,
    tier: Tier,
    reason: str | None,
) -> None:
    """A read of `key` from lower tier `tier` failed for `reason`: if the copy is gone or bad,
    never trust it again (forgotten, announced, counted)."""
    if reason in COPY_LOST:
        if index.set_present([key], tier, False):
            events.add("removed", (key,), tier)
        stats[f"{tier.value}_read_{reason}_blocks"] += 1
