"""Host <-> lower tier legs: one batch on the tier, straight on host-pool memory (job_bodies.py
`tier_batch`: bounded waits, late-I/O fencing, the status table)."""

from __future__ import annotations

from typing import Protocol

from flexkv_py.coordinator.leg_handlers import Moved
from flexkv_py.coordinator.legs import Blocks, Host, Leg, OnTier
from flexkv_py.index.tier_names import Tier


class TierBatches(Protocol):
    """What these handlers need of the job bodies."""

    @property
    def slot_nbytes(self) -> int: ...

    def tier_batch(
        self,
        tier: Tier,
        put: bool,
        keys: tuple[bytes, ...] | list[bytes],
        slots: tuple[int, ...] | list[int],
        extras: Blocks | None = None,
    ) -> dict[bytes, str]: ...


class TierBatch:
    """Move a leg's blocks between their host slots and a lower tier in one batch: `put`
    writes them to the tier (with their parents and metas where it keeps them), else reads
    them into the slots."""

    def __init__(self, bodies: TierBatches, *, put: bool) -> None:
        self.bodies = bodies
        self.put = put

    def move(self, leg: Leg) -> Moved:
        host, lower = (leg.src, leg.dst) if self.put else (leg.dst, leg.src)
        assert isinstance(host, Host) and isinstance(lower, OnTier)  # registered for this pair
        extras = leg.blocks if self.put else None
        failed = self.bodies.tier_batch(lower.tier, self.put, leg.keys, host.slots, extras)
        return Moved(failed, (len(leg.keys) - len(failed)) * self.bodies.slot_nbytes)
