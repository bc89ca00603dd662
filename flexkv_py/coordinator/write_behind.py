"""Write-behind: host blocks reach the spill tier (SSD) in the background, so a restart or a
crash finds them there (warm after restart with the default write-back admission).

A block is queued when its store commits (write-through blocks are already on their way). The
manager hands out a write-behind job only when nothing else is queued for the workers and no
load or store is in flight, within the rate (`write_behind_mib_s`), so it never stalls a load or
a step; a block that has waited `write_behind_lag_s` is written even while the tier is busy (the
lag is the guarantee a `kill -9` relies on), still within the rate. The job is a SpillJob body
(host slot -> tier) with the host copy kept: the block is pinned while its write is in flight
(readable from host, never evicted or its slot reused) and unpinned when the write commits.
Admission (`min_hits`) is checked when the write is handed out: a block seen too rarely is left
to the eviction path. `take_write_behind(drain=True)` ignores idleness and rate (shutdown flush,
bounded by the caller's deadline).
"""

from __future__ import annotations

from collections.abc import Iterable

from flexkv_py.coordinator.eviction import HostEviction
from flexkv_py.coordinator.jobs import JobResult, LoadJob, SpillJob, StoreJob
from flexkv_py.coordinator.write_behind_queue import WriteBehindQueue
from flexkv_py.index.tier_names import Tier

# Most blocks in one write-behind job: small jobs keep each one short behind a load.
MAX_JOB_BLOCKS = 256


class WriteBehind(HostEviction):
    def _queue_write_behind(self, keys: Iterable[bytes]) -> None:
        """Blocks whose host copy just became readable and that have no spill-tier copy."""
        wb = self._write_behind
        if wb is None:
            return
        tier = self.spill_tier
        assert tier is not None
        for key in self.index.lacking_on(keys, tier):  # one lock for the batch
            wb.add(key)

    def _busy(self) -> bool:
        return bool(self._background) or any(
            isinstance(j, (LoadJob, StoreJob)) for j in self._inflight.values()
        )

    def take_write_behind(self, *, drain: bool = False) -> SpillJob | None:
        """The next write-behind job (also queued for `take_jobs`), or None: nothing owed, a
        write-behind still in flight, the workers busy with a younger backlog, or the rate spent.
        `drain`: ignore idleness and the rate (shutdown flush)."""
        with self._lock:
            wb, tier = self._write_behind, self.spill_tier
            if wb is None or tier is None or self._write_behind_jobs:
                return None
            budget = self._job_budget(wb, drain)
            if budget <= 0:
                return None
            keys, slots = [], []
            admit, hits = self.admission.admit_on_evict, self.index.hits
            for key in wb.take(budget):
                slot = self.index.host_slot_of(key)
                if slot is None or not admit(hits(key)) or not self.index.begin_write(key, tier):
                    continue  # gone from host, not admitted (eviction decides) or on its way
                self.index.pin([key])  # host copy kept readable, slot never reused
                keys.append(key)
                slots.append(slot)
            if not keys:
                return None
            if not drain:
                wb.spend(len(keys))
            job = SpillJob(
                next(self._ids), tuple(keys), tuple(slots), tier, drop_first=self._take_drops()
            )
            self._inflight[job.job_id] = job
            self._write_behind_jobs.add(job.job_id)
            self._background.append(job)
            return job

    def _job_budget(self, queue: WriteBehindQueue, drain: bool) -> int:
        """Blocks the next write-behind job from `queue` may take now: 0 when nothing is owed,
        or the workers are busy with a younger backlog, or the rate is spent."""
        if not len(queue) or (not drain and self._busy() and not queue.overdue()):
            return 0
        # At most an eighth of the host tier pinned by it: eviction always finds victims.
        most = max(1, min(MAX_JOB_BLOCKS, self.num_host_slots // 8))
        return most if drain else min(most, queue.budget())

    def take_jobs_now(self, job: SpillJob | LoadJob) -> SpillJob | LoadJob:
        """Hand `job` (from take_write_behind) to a caller that submits it at once, instead of
        to the next `take_jobs`."""
        with self._lock:
            self._background.remove(job)
            return job

    def _complete_write_behind(self, job: SpillJob, result: JobResult) -> None:
        self._write_behind_jobs.discard(job.job_id)
        self._commit_pinned_writes(job, result, "write_behind")

    def _commit_pinned_writes(self, job: SpillJob, result: JobResult, stat: str) -> None:
        """A write-behind job's blocks (host copies pinned while written) reached its tier, or
        not: commit, unpin, count `{stat}_blocks` / `{stat}_failed_blocks`, announce."""
        for key in job.keys:
            ok = key not in result.failed
            self.index.commit_write(key, job.tier, ok)
            self.index.unpin([key])
            if ok:
                self._stats[f"{stat}_blocks"] += 1
                if self.index.readable_on(key, job.tier):  # not reset while it was written
                    self._event("stored", key, job.tier)
            else:
                self._stats[f"{stat}_failed_blocks"] += 1

    def write_behind_pending(self) -> int:
        """Blocks still owed to the spill tier (queued or being written)."""
        with self._lock:
            wb = self._write_behind
            queued = len(wb) if wb is not None else 0
            flying = sum(len(self._inflight[j].keys) for j in self._write_behind_jobs)
            return queued + flying

    def _written_per_served(self) -> float | None:
        """SSD wear: blocks written to the spill tier per block it served (None: none served)."""
        tier = self.spill_tier or Tier.SSD
        s = self._stats
        written = s[f"{tier.value}_written_blocks"] + s["spilled_blocks"]
        written += s["write_behind_blocks"]
        served = s[f"load_{tier.value}_blocks"]
        return written / served if served else None
