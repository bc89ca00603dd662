"""Host space for the manager: slots for jobs, eviction per policy, spills to the lower tier.

A job that needs slots takes free ones first, then evicts per policy. A victim that must reach the
spill tier first (write-back) travels inside the job (`spill_keys`): the worker writes it out
before reusing its slot. To keep that off the critical path the manager also keeps `free_target`
of the slots free-or-spilling with background SpillJobs; a spilled slot is free only once its
write is confirmed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexkv_py.coordinator.jobs import Drops, JobResult, LoadJob, SpillJob, StoreJob
from flexkv_py.coordinator.manager_state import ManagerState
from flexkv_py.index.cold_blocks import DIGEST_LEN
from flexkv_py.index.entry import Victim
from flexkv_py.index.tier_names import Tier


class HostEviction(ManagerState):
    def _take_slots(self, n: int, chained: list[Victim]) -> list[int]:
        """Up to n slots for a job, evicting host blocks as needed. A victim that must reach the
        spill tier first is appended to `chained`: the job writes it out before reusing its slot."""
        slots = self.index.allocate_slots(n)
        while len(slots) < n:
            victim = self.index.begin_evict()
            if victim is None:
                break
            self._left_host(victim.key)
            if self._needs_spill(victim):
                chained.append(victim)
                self.index.finish_evict(victim.key)  # pending lower write only: not readable
                self._event("removed", victim.key, Tier.HOST)
            else:
                self._drop(victim)
            # LIFO free list: this returns the victim's slot, so it stays inside this job.
            slots += self.index.allocate_slots(n - len(slots))
        return slots

    def grow_host_slots(self, usable: int) -> None:
        """Every worker's pool has its first `usable` slots ready: the host tier may use them."""
        with self._lock:
            added = self.index.grow_usable_slots(usable)
            if added:
                self._stats["host_slots_ready"] = self.index.usable_host_slots

    def _keep_reserve(self) -> None:
        """Start evictions so that free + spilling slots reach the reserve target."""
        while self.index.free_slots + self._spilling < self._free_target:
            victim = self.index.begin_evict()
            if victim is None:
                break
            self._evict(victim)
        self._flush_spills()

    def _needs_spill(self, v: Victim) -> bool:
        """Should this victim reach the spill tier before its slot is reused? Marks the write in
        flight. A victim the tier has no room for is dropped (counted: its cached children, if
        any, are orphans from then on)."""
        tier = self.spill_tier
        if tier is None or tier in v.lower or not self.admission.admit_on_evict(v.hits):
            return False
        if self.index.begin_write(v.key, tier):
            return True
        self._stats[f"{tier.value}_spill_refused_blocks"] += 1
        return False

    def _take_drops(self) -> Drops:
        """The lower-tier evictions the index chose since the last call (to make room for
        writes begun since): the next job deletes them before it writes anything. Counted
        here; those named by key are announced here, those named by fingerprint (cold blocks)
        when the job's result names their keys (`_announce_dropped`)."""
        taken, prints = self.index.take_lower_drops()
        for tier, keys in taken.items():
            for key in keys:
                self._event("removed", key, tier)
        for tier in {*taken, *prints}:
            n = len(taken.get(tier, ())) + len(prints.get(tier, b"")) // DIGEST_LEN
            self._stats[f"{tier.value}_evicted_blocks"] += n
            self._stats[f"{tier.value}_index_evicted_blocks"] += n
        return Drops({tier: tuple(keys) for tier, keys in taken.items()}, prints)

    def _announce_dropped(self, dropped: Mapping[Tier, Sequence[bytes]]) -> None:
        """A worker deleted these blocks that the scheduler had named by fingerprint: announce
        each, unless the index holds it on that tier again (stored anew since; or a
        fingerprint clash took a block it still holds, which its first load then finds
        missing and forgets)."""
        for tier, keys in dropped.items():
            on = self.index.readable_on
            gone = [k for k in keys if not on(k, tier)]
            if gone:
                self._events_of("removed", gone, tier)

    def _drop(self, v: Victim) -> None:
        self.index.finish_evict(v.key)
        self._event("removed", v.key, Tier.HOST)
        self._stats["host_evicted_blocks"] += 1

    def _left_host(self, key: bytes) -> None:
        """A victim owes write-behind nothing any more: eviction spills or drops it."""
        if self._write_behind is not None:
            self._write_behind.discard(key)

    def _evict(self, v: Victim) -> None:
        """Background eviction: spill (slot freed when the SpillJob completes) or drop."""
        self._left_host(v.key)
        if self._needs_spill(v):
            self._spill_batch.append(v)
            self._spilling += 1
        else:
            self._drop(v)

    def _spill_done(self, key: bytes, tier: Tier, ok: bool) -> None:
        """Count (and announce) a spill whose write the index has committed."""
        if ok:
            self._stats["spilled_blocks"] += 1
            if self.index.readable_on(key, tier):  # not reset while it was written
                self._event("stored", key, tier)
        else:
            self._stats["spill_failed_blocks"] += 1

    def _complete_chained(self, job: StoreJob | LoadJob, result: JobResult) -> None:
        for key in job.spill_keys:
            ok = key not in result.spill_failed
            self.index.commit_write(key, job.spill_tier, ok)
            self._spill_done(key, job.spill_tier, ok)

    def _flush_spills(self) -> None:
        if not self._spill_batch:
            return
        assert self.spill_tier is not None, "spills are planned only with a spill tier"
        job = SpillJob(
            job_id=next(self._ids),
            keys=tuple(v.key for v in self._spill_batch),
            host_slots=tuple(v.host_slot for v in self._spill_batch),
            tier=self.spill_tier,
            drop_first=self._take_drops(),  # room the index made for these writes
        )
        self._spill_batch = []
        self._inflight[job.job_id] = job
        self._background.append(job)

    def _complete_spill(self, job: SpillJob, result: JobResult) -> None:
        for key in job.keys:
            ok = key not in result.failed
            self.index.commit_write(key, job.tier, ok)
            self.index.finish_evict(key)
            self._event("removed", key, Tier.HOST)
            self._spill_done(key, job.tier, ok)
        self._spilling -= len(job.keys)
