"""The worker's deletes: a DropJob, and a job's `drop_first` (room for its writes), run on this
rank; both are a `Drops` (jobs.py).

The scheduler names blocks by key where it knows the key (warm blocks, orphans, garbage after a
reset): those deletes are legs from a lower tier to `Gone`, run through the executor's handlers
(the one registered for them, tier_handlers.py `TierDelete`, calls `delete_keys` here). It names
them by fingerprint where it does not (cold blocks: flexkv_py/index/cold_blocks.py keeps only
8-byte digests): a tier that resolves fingerprints (the SSD store, whose key table is hashed by
them: tiers/ssd/tier.py `delete_fingerprints`) deletes the keys they name; a reset also deletes
the rank's whole namespace on the tiers it names (`delete_namespace`). Either way the logical
keys deleted go back in the job's result (`JobResult.dropped`), and the manager announces them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import DropJob, Drops, JobResult
from flexkv_py.coordinator.leg_handlers import Handlers
from flexkv_py.errors import FlexKVError
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import LowerTier

logger = logging.getLogger(__name__)

T = TypeVar("T")
_NO_KEYS: list[bytes] = []  # what a refused delete resolved (never appended to)


class TierDeletes:
    """Deletes on the lower tiers: a DropJob's body, a job's `drop_first`, the keyed deletes
    their legs ask for, and what each tier evicted on its own (reported with every job's
    result). `handlers`: the executor's, which run the keyed-delete legs."""

    def __init__(
        self, tiers: Mapping[Tier, LowerTier], stats: Counters, handlers: Handlers
    ) -> None:
        self.tiers = tiers
        self.stats = stats
        self.handlers = handlers

    def evicted(self) -> dict[Tier, tuple[bytes, ...]]:
        """What each tier dropped on its own since the last job asked."""
        out: dict[Tier, tuple[bytes, ...]] = {}
        for tier, lower in self.tiers.items():
            keys = tuple(lower.drain_evicted())
            if keys:
                out[tier] = keys
        return out

    def _deleting(self, tier: Tier, failed: T, call: Callable[..., T], *args: object) -> T:
        """`call(*args)` (a delete on `tier`), or `failed` if the tier refused it. A job's
        `drop_first` runs in the thread submitting the job (a vLLM worker's step): a failed
        delete must stop neither. The SSD store forgets the keys before journaling their
        deletes, so the room is free anyway; a restart may bring them back, and the index
        evicts them again."""
        try:
            return call(*args)
        except FlexKVError as e:
            logger.warning("%s delete failed (may come back after a restart): %s", tier.value, e)
            self.stats.add(f"{tier.value}_delete_errors")
            return failed

    def delete_keys(self, tier: Tier, keys: Sequence[bytes]) -> int:
        """Delete `keys` from `tier` (a deletion leg's blocks); how many it held. A tier this
        rank lacks holds none."""
        lower = self.tiers.get(tier)
        if lower is None or not keys:
            return 0
        n = self._deleting(tier, 0, lower.delete, keys)
        self.stats.add(f"{tier.value}_deleted_blocks", n)
        return n

    def run(self, drops: Drops) -> dict[Tier, tuple[bytes, ...]]:
        """Run `drops` (a DropJob's; a job's `drop_first`, room for its writes, before the
        job): its deletion legs through the handlers, then its fingerprints. Returns what the
        fingerprints resolved to, per tier, for the job's result (for a `drop_first`, the
        executor attaches it whether the job then succeeds or crashes)."""
        for leg in drops.legs:
            self.handlers.move(leg)
        return self._delete_prints(drops.prints)

    def _delete_prints(self, prints: Mapping[Tier, bytes]) -> dict[Tier, tuple[bytes, ...]]:
        """Delete the blocks named by fingerprint per tier (joined 8-byte digests) on the tiers
        that resolve them (tiers/ssd/tier.py); the logical keys deleted, per tier."""
        out: dict[Tier, tuple[bytes, ...]] = {}
        for tier, joined in prints.items():
            delete = getattr(self.tiers.get(tier), "delete_fingerprints", None)
            if delete is not None and joined:
                keys = tuple(self._deleting(tier, _NO_KEYS, delete, joined))
                self.stats.add(f"{tier.value}_deleted_blocks", len(keys))
                if keys:
                    out[tier] = keys
        return out

    def drop(self, job: DropJob, started: float) -> JobResult:
        dropped = self.run(job.drops)
        for tier in job.wipe_namespace_on:  # a reset: every block of this rank's namespace
            delete = getattr(self.tiers.get(tier), "delete_namespace", None)
            if delete is not None:
                keys = tuple(self._deleting(tier, _NO_KEYS, delete))
                self.stats.add(f"{tier.value}_deleted_blocks", len(keys))
                dropped[tier] = dropped.get(tier, ()) + keys
        return JobResult(
            job.job_id,
            "drop",
            evicted=self.evicted(),
            seconds=time.perf_counter() - started,
            dropped=dropped,
        )
