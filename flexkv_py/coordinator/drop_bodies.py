"""The worker's deletes: a DropJob, and a job's `drop_first` (room for its writes), run on this
rank tier by tier.

The scheduler names blocks by key where it knows the key (warm blocks, orphans, garbage after a
reset) and by fingerprint where it does not (cold blocks: flexkv_py/index/cold_blocks.py keeps
only 8-byte digests). A tier that resolves fingerprints (the SSD store, whose key table is
hashed by them: tiers/ssd/tier.py `delete_fingerprints`) deletes the keys they name; a reset
deletes the rank's whole namespace there (`delete_namespace`). Either way the logical keys
deleted go back in the job's result (`JobResult.dropped`), and the manager announces them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import DropJob, Drops, JobResult
from flexkv_py.errors import FlexKVError
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import LowerTier

logger = logging.getLogger(__name__)

T = TypeVar("T")
_NO_KEYS: list[bytes] = []  # what a refused delete resolved (never appended to)


class TierDeletes:
    """Deletes on the lower tiers: a DropJob's body, a job's `drop_first`, and what each tier
    evicted on its own (reported with every job's result)."""

    def __init__(self, tiers: Mapping[Tier, LowerTier], stats: Counters) -> None:
        self.tiers = tiers
        self.stats = stats

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

    def delete(self, drops: Mapping[Tier, Sequence[bytes]]) -> None:
        """Delete blocks per tier by key (a DropJob's keys, a job's `drop_first.keys`)."""
        for tier, keys in drops.items():
            lower = self.tiers.get(tier)
            if lower is not None and keys:
                n = self._deleting(tier, 0, lower.delete, keys)
                self.stats.add(f"{tier.value}_deleted_blocks", n)

    def drop_first(self, drops: Drops) -> dict[Tier, tuple[bytes, ...]]:
        """A job's `drop_first` (room for its writes), run before the job: by key, then by
        fingerprint. Returns what the fingerprints resolved to, per tier, for the job's result
        (the executor attaches it, whether the job then succeeds or crashes)."""
        self.delete(drops.keys)
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
        self.delete(dict.fromkeys(job.tiers, job.keys))
        dropped = self._delete_prints(dict.fromkeys(job.tiers, job.prints))
        if job.namespace:  # a reset: every block of this rank's namespace there
            for tier in job.tiers:
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
