"""Host space for the manager: slots for jobs, eviction per policy, spills to the spill tier.

A job that needs slots takes free ones first, then evicts per policy. A victim that must reach the
spill tier first (write-back) travels inside the job (its `spill` leg): the worker writes it out
before reusing its slot. To keep that off the critical path the manager also keeps `free_target`
of the slots free-or-spilling with background SpillJobs; a spilled slot is free only once its
write is confirmed.

Every method runs under the manager's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from flexkv_py.coordinator.jobs import Drops, Job, JobResult, LoadJob, SpillJob, StoreJob
from flexkv_py.coordinator.kv_events import EventQueue
from flexkv_py.coordinator.legs import NO_SPILL, Blocks, Leg, write_out
from flexkv_py.coordinator.outbox import Outbox
from flexkv_py.index.cold_blocks import DIGEST_LEN
from flexkv_py.index.entry import Victim
from flexkv_py.index.policies import AdmissionPolicy
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier


def spill_of(victims: Sequence[Victim], tier: Tier | None) -> Leg:
    """The leg a job runs first: the evicted `victims` written out of the slots it reuses, to
    `tier` (a job with no victims spills nothing)."""
    if not victims:
        return NO_SPILL
    keys = tuple(v.key for v in victims)
    return write_out(Blocks(keys), [v.host_slot for v in victims], tier or Tier.SSD)


class HostSpace:
    def __init__(
        self,
        index: TierIndex,
        admission: AdmissionPolicy,
        spill_tier: Tier | None,
        outbox: Outbox,
        events: EventQueue,
        stats: Counter[str],
        *,
        free_target: int,
    ) -> None:
        self._index = index
        self._admission = admission
        self.spill_tier = spill_tier  # None: blocks leaving host are dropped
        self._outbox = outbox
        self._events = events
        self._stats = stats
        self.free_target = free_target
        self.spilling = 0  # slots held by in-flight spills
        self._spill_batch: list[Victim] = []
        # Called with a victim's key: the spill tier's write-behind is owed nothing any more
        # (eviction spills or drops the block). Set by the manager once that writer exists.
        self.on_left_host: Callable[[bytes], None] | None = None

    def take_slots(self, n: int, chained: list[Victim]) -> list[int]:
        """Up to n slots for a job, evicting host blocks as needed. A victim that must reach the
        spill tier first is appended to `chained`: the job writes it out before reusing its slot."""
        index = self._index
        slots = index.allocate_slots(n)
        while len(slots) < n:
            victim = index.begin_evict()
            if victim is None:
                break
            self._left_host(victim.key)
            if self._needs_spill(victim):
                chained.append(victim)
                index.finish_evict(victim.key)  # pending lower write only: not readable
                self._events.add("removed", (victim.key,), Tier.HOST)
            else:
                self._drop(victim)
            # LIFO free list: this returns the victim's slot, so it stays inside this job.
            slots += index.allocate_slots(n - len(slots))
        return slots

    def grow(self, usable: int) -> None:
        """Every worker's pool has its first `usable` slots ready: the host tier may use them."""
        if self._index.grow_usable_slots(usable):
            self._stats["host_slots_ready"] = self._index.usable_host_slots

    def keep_reserve(self) -> None:
        """Start evictions so that free + spilling slots reach the reserve target."""
        index = self._index
        while index.free_slots + self.spilling < self.free_target:
            victim = index.begin_evict()
            if victim is None:
                break
            self._evict(victim)
        self.flush_spills()

    def free_beyond_reserve(self) -> int:
        """Free slots a job may take without eating into the reserve (a prefetch, say)."""
        return self._index.free_slots - self.free_target

    def _needs_spill(self, v: Victim) -> bool:
        """Should this victim reach the spill tier before its slot is reused? Marks the write in
        flight. A victim the tier has no room for is dropped (counted: its cached children, if
        any, are orphans from then on)."""
        tier = self.spill_tier
        if tier is None or tier in v.lower or not self._admission.admit_on_evict(v.hits):
            return False
        if self._index.begin_write(v.key, tier):
            return True
        self._stats[f"{tier.value}_spill_refused_blocks"] += 1
        return False

    def take_drops(self) -> Drops:
        """The lower-tier evictions the index chose since the last call (to make room for
        writes begun since): the next job deletes them before it writes anything. Counted
        here; those named by key are announced here, those named by fingerprint (cold blocks)
        when the job's result names their keys (`announce_dropped`)."""
        taken, prints = self._index.take_lower_drops()
        for tier, keys in taken.items():
            self._events.add("removed", keys, tier)
        for tier in {*taken, *prints}:
            n = len(taken.get(tier, ())) + len(prints.get(tier, b"")) // DIGEST_LEN
            self._stats[f"{tier.value}_evicted_blocks"] += n
            self._stats[f"{tier.value}_index_evicted_blocks"] += n
        return Drops.of(taken, prints)

    def announce_dropped(self, dropped: Mapping[Tier, Sequence[bytes]]) -> None:
        """A worker deleted these blocks that the scheduler had named by fingerprint: announce
        each, unless the index holds it on that tier again (stored anew since; or a
        fingerprint clash took a block it still holds, which its first load then finds
        missing and forgets)."""
        on = self._index.readable_on
        for tier, keys in dropped.items():
            gone = [k for k in keys if not on(k, tier)]
            if gone:
                self._events.add("removed", gone, tier)

    def _drop(self, v: Victim) -> None:
        self._index.finish_evict(v.key)
        self._events.add("removed", (v.key,), Tier.HOST)
        self._stats["host_evicted_blocks"] += 1

    def _left_host(self, key: bytes) -> None:
        if self.on_left_host is not None:
            self.on_left_host(key)

    def _evict(self, v: Victim) -> None:
        """Background eviction: spill (slot freed when the SpillJob completes) or drop."""
        self._left_host(v.key)
        if self._needs_spill(v):
            self._spill_batch.append(v)
            self.spilling += 1
        else:
            self._drop(v)

    def _spill_done(self, key: bytes, tier: Tier, ok: bool) -> None:
        """Count (and announce) a spill whose write the index has committed."""
        if ok:
            self._stats["spilled_blocks"] += 1
            if self._index.readable_on(key, tier):  # not reset while it was written
                self._events.add("stored", (key,), tier)
        else:
            self._stats["spill_failed_blocks"] += 1

    def complete_chained(self, job: StoreJob | LoadJob, result: JobResult) -> None:
        """The victims a store or load wrote out before reusing their slots."""
        tier = job.spill.tier or Tier.SSD
        for key in job.spill.keys:
            ok = key not in result.spill_failed
            self._index.commit_write(key, tier, ok)
            self._spill_done(key, tier, ok)

    def flush_spills(self) -> None:
        """The background evictions chosen so far go out as one SpillJob."""
        if not self._spill_batch:
            return
        assert self.spill_tier is not None, "spills are planned only with a spill tier"
        job = SpillJob(
            self._outbox.new_id(),
            spill_of(self._spill_batch, self.spill_tier),
            drop_first=self.take_drops(),  # room the index made for these writes
        )
        self._spill_batch = []
        self._outbox.track(job, self._complete_spill, background=True)

    def _complete_spill(self, job: Job, result: JobResult) -> None:
        assert isinstance(job, SpillJob)
        index = self._index
        for key in job.keys:
            ok = key not in result.failed
            index.commit_write(key, job.tier, ok)
            index.finish_evict(key)
            self._events.add("removed", (key,), Tier.HOST)
            self._spill_done(key, job.tier, ok)
        self.spilling -= len(job.keys)
