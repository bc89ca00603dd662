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


class HostToTier:
    """Write a leg's blocks from their host slots to a lower tier (with their parents and metas
    where the tier keeps them)."""

    def __init__(self, bodies: TierBatches) -> None:
        self.bodies = bodies

    def move(self, leg: Leg) -> Moved:
        host, lower = leg.src, leg.dst
        assert isinstance(host, Host) and isinstance(lower, OnTier)  # registered for this pair
        failed = self.bodies.tier_batch(lower.tier, True, leg.keys, host.slots, leg.blocks)
        return Moved(failed, (len(leg.keys) - len(failed)) * self.bodies.slot_nbytes)


class TierToHost:
    """Read a leg's blocks from a lower tier into their host slots, in one batch."""

    def __init__(self, bodies: TierBatches) -> None:
        self.bodies = bodies

    def move(self, leg: Leg) -> Moved:
        lower, host = leg.src, leg.dst
        assert isinstance(lower, OnTier) and isinstance(host, Host)  # registered for this pair
        failed = self.bodies.tier_batch(lower.tier, False, leg.keys, host.slots)
        return Moved(failed, (len(leg.keys) - len(failed)) * self.bodies.slot_nbytes)
