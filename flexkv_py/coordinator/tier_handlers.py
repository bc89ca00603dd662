"""Lower-tier legs. Host <-> lower tier: one batch on the tier, straight on host-pool memory
(job_bodies.py `tier_batch`: bounded waits, late-I/O fencing, the status table). Lower tier ->
`Gone`: one delete on the tier (drop_bodies.py `TierDeletes.delete_keys`)."""

from __future__ import annotations

from typing import Protocol

from flexkv_py.coordinator.leg_handlers import Moved
from flexkv_py.coordinator.legs import Blocks, Gone, Host, Leg, OnTier
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


class KeyDeletes(Protocol):
    """What the delete handler needs of the tier deletes (drop_bodies.py)."""

    def delete_keys(self, tier: Tier, keys: tuple[bytes, ...]) -> int: ...


class TierDelete:
    """Delete a leg's blocks from its lower tier, by key, in one call. No block fails: a key
    the tier does not hold is gone already, and a delete the tier refuses is logged and
    counted, never raised (`TierDeletes._deleting` says why); a later job finds what is left."""

    def __init__(self, deletes: KeyDeletes) -> None:
        self.deletes = deletes

    def move(self, leg: Leg) -> Moved:
        assert isinstance(leg.src, OnTier) and isinstance(leg.dst, Gone)  # registered for this
        self.deletes.delete_keys(leg.src.tier, leg.keys)
        return Moved()
