"""Bounded lower-tier waits: a stuck device becomes per-block `io_timeout` failures, never a
hung job.

Every wait of the executor on a lower tier's batch is bounded by ``ssd_io_timeout_s`` (the
object tier's by ``object_store_io_timeout_s``). When it runs out, the batch's blocks fail with
IO_TIMEOUT at once (a load reports them as load errors and vLLM recomputes them; a store does
not commit their lower-tier copies; a spill loses its victims), and the job ends. The I/O itself
cannot be cancelled (the kernel, or an io_uring, may still read or write the host slots hours
later), so its slots are *fenced* here until the batch really completes:

- nothing may write into a fenced slot: a store whose host slot is fenced fails that block
  (no GPU->host copy, no fill into it), a load does not stage a tier read into a fenced slot
  (the block fails as IO_TIMEOUT). A late read could otherwise land in a slot that now holds
  another block (wrong KV served), and a late write could otherwise persist bytes that a later
  job put there under the old key (wrong KV after a restart);
- reading a fenced slot is harmless: a slot fenced by a late read holds no valid block (its
  block failed), one fenced by a late write still holds the block the write reads;
- the host pool and the lower tiers are not closed while any slot is fenced (see
  JobExecutor.shutdown).

The manager never learns about fences: it frees the slots of failed blocks as usual and may hand
them out again; the executor keeps failing writes into them until the late I/O ends. A timed-out
read makes the manager forget that tier's copy, as an io_error does: a copy kept would be
promised again by every lookup while the device is stuck (a loop of load errors); forgotten, the
block is recomputed and stored again (the bytes on the device are untouched: a restart may adopt
them).

A load that stages many blocks reads them in sub-batches, several in flight
(coordinator/job_bodies.py): each sub-batch is waited with the bound in turn, and a timeout
fences that sub-batch's slots only. The device is then taken to be stuck: no further sub-batch
is submitted (those blocks fail as IO_TIMEOUT, touching no slot), and the sub-batches already in
flight, which have been running at least as long as the bound, are checked without waiting: those
done count, the others are fenced too. A load streamed in rounds through reused slots
(coordinator/loads.py) keeps the device stuck for its later rounds: they submit nothing to it,
so the load waits one bound, not one per round.

Stats are labelled by tier (``ssd_io_timeouts``, ``ssd_io_timeout_blocks``, ``ssd_fenced_slots``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from flexkv_py.coordinator.jobs import IO_TIMEOUT, JobResult, StoreJob
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import BatchLike

logger = logging.getLogger(__name__)


class LateIo:
    """Bounded waits on lower-tier batches and the host slots that timed-out batches may still
    touch. `tiers`: those whose fence count is always in `stats` (others once they fence)."""

    def __init__(
        self,
        timeout_s: float,
        tiers: Iterable[Tier] = (),
        tier_timeouts: Mapping[Tier, float] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"ssd_io_timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        # Tiers with a bound of their own (the object tier: object_store_io_timeout_s).
        self.tier_timeouts = dict(tier_timeouts or {})
        for tier, bound in self.tier_timeouts.items():
            if not bound > 0:
                raise ValueError(f"{tier.value} I/O timeout must be > 0, got {bound}")
        self._lock = threading.Lock()
        # host slot -> the late batches that may touch it, each with its tier. Several: a slot
        # fenced by a late write still holds its block, which another write may read (a spill)
        # and time out on too; the fence holds until the last of them completes, whatever order
        # the device completes them in.
        self._held: dict[int, list[tuple[BatchLike, Tier]]] = {}
        self._tiers = dict.fromkeys(tiers)
        self._stats: Counter[str] = Counter()
        self._timeout_blocks = 0

    def wait(
        self,
        batch: BatchLike,
        slots: Sequence[int],
        what: str,
        tier: Tier,
        timeout: float | None = None,
    ) -> list[Any] | None:
        """The batch's results, or None if it is not done within the bound (`timeout`, default
        ssd_io_timeout_s): then its `slots` are fenced until it completes (callers fail its
        blocks with IO_TIMEOUT)."""
        bound = self.tier_timeouts.get(tier, self.timeout_s) if timeout is None else timeout
        try:
            return batch.wait(bound)
        except TimeoutError:
            pass
        with self._lock:
            for slot in slots:
                self._held.setdefault(slot, []).append((batch, tier))
            self._tiers.setdefault(tier)
            self._stats[f"{tier.value}_io_timeouts"] += 1
            self._stats[f"{tier.value}_io_timeout_blocks"] += len(slots)
            self._timeout_blocks += len(slots)
        logger.error(
            "%s %s of %d blocks not done after %g s (%s): the blocks fail "
            "(io_timeout) and their host slots stay fenced until the device completes it",
            tier.value,
            what,
            len(slots),
            bound,
            "object_store_io_timeout_s" if tier is Tier.OBJECT else "ssd_io_timeout_s",
        )
        return None

    def _prune(self) -> None:
        """Drop fences of batches that completed (lock held)."""
        for slot in list(self._held):
            late = [(b, t) for b, t in self._held[slot] if not b.done()]
            if late:
                self._held[slot] = late
            else:
                del self._held[slot]

    def fenced(self, slots: Iterable[int]) -> set[int]:
        """Those of `slots` that a timed-out batch may still read or write."""
        with self._lock:
            if not self._held:
                return set()
            self._prune()
            out = {s for s in slots if s in self._held}
            self._stats["fenced_slot_hits"] += len(out)
            return out

    def pending(self) -> int:
        """Host slots still fenced."""
        with self._lock:
            self._prune()
            return len(self._held)

    def settle(self, timeout: float | None) -> bool:
        """Wait (bounded) until no late batch is left; True if none is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            batches = list({id(b): b for late in self._held.values() for b, _ in late}.values())
        for b in batches:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                b.wait(remaining)
            except TimeoutError:
                return False
        return self.pending() == 0

    @property
    def timeout_blocks(self) -> int:
        """Blocks whose lower-tier I/O timed out so far, over all tiers (a running count)."""
        with self._lock:
            return self._timeout_blocks

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._prune()
            out = dict(self._stats)
            fenced = Counter(late[0][1] for late in self._held.values())
            for tier in self._tiers:
                out[f"{tier.value}_fenced_slots"] = fenced[tier]
        return out


def fence_store(job: StoreJob, fenced: set[int], fills: bool) -> tuple[StoreJob, tuple[bytes, ...]]:
    """The part of a store that writes no fenced slot, and the keys left out (they fail with
    IO_TIMEOUT). A host-only store's `fill` writes every slot of the job, so with a fill and any
    fenced slot nothing of the job runs."""
    if not fenced:
        return job, ()
    keep = [i for i, s in enumerate(job.host_slots) if s not in fenced and not fills]
    kept = set(keep)
    left_out = tuple(k for i, k in enumerate(job.keys) if i not in kept)
    part = job.take(keep)
    logger.warning(
        "store job %d: %d blocks fail (io_timeout): their host slots are still under a "
        "timed-out lower-tier I/O",
        job.job_id,
        len(left_out),
    )
    return part, left_out


def with_failed(result: JobResult, keys: Sequence[bytes]) -> JobResult:
    """`result` with `keys` failed as IO_TIMEOUT too."""
    if not keys:
        return result
    return replace(result, failed={**result.failed, **dict.fromkeys(keys, IO_TIMEOUT)})
