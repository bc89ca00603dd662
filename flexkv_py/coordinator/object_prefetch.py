"""Prefetch of a bucket hit: blocks the scheduler's object lookup matched move object -> host in
the background, before the request's load, so that the load is served from host memory.

What is prefetched, precisely: the matched run past the host and SSD matches (the blocks whose
best copy is `Tier.OBJECT`), root first, at most `object_store_prefetch_blocks` of them and at
most the free host slots beyond the free reserve (never by evicting: a prefetch takes only room
nobody uses). It is one host-only LoadJob (no GPU blocks), handed to the workers with the other
background jobs, whose blocks are filled into their slots (promoted: ordinary host blocks once
it lands). A block already filling, or whose best copy is no longer the bucket, is left out.

Why it never delays a step or serves wrong KV: the job runs on the workers' job threads like a
spill; the scheduler answers vLLM "ask again later" while it is in flight (integration/vllm/
scheduler_side_object.py, bounded by `object_store_lookup_wait_s`), so the request holds no GPU
blocks during the network reads and its load, once scheduled, reads host memory. A block not
prefetched in time, or beyond the cap, is staged by the load itself (object -> host -> GPU) as
before. Every object read is verified by the tier (header and checksum); a block that fails is
not promoted, and a lost or bad copy is forgotten (the load recomputes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flexkv_py.coordinator.jobs import JobResult, LoadJob
from flexkv_py.coordinator.write_behind_object import ObjectWriteBehind
from flexkv_py.index.entry import IndexStateError
from flexkv_py.index.tier_names import Tier


class ObjectPrefetch(ObjectWriteBehind):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefetch_jobs: set[int] = set()  # in flight

    def prefetch_object(self, keys: Sequence[bytes]) -> int | None:
        """Start moving `keys` (a matched run on the object tier, root first) object -> host;
        returns the job's id, None when nothing was started (see the module docstring)."""
        cap = self.config.object_store_prefetch_blocks
        with self._lock:
            room = min(cap, self.index.free_slots - self._free_target, len(keys))
            if room <= 0:
                return None
            located = self.index.acquire(keys[:room])  # pinned: not evicted nor dropped
            wanted = [k for k, at in zip(keys, located, strict=False) if at.tier is Tier.OBJECT]
            self.index.unpin(
                [k for k, at in zip(keys, located, strict=False) if at.tier is not Tier.OBJECT]
            )
            slots = self.index.allocate_slots(len(wanted))
            taken: list[bytes] = []
            for key in wanted:
                if len(taken) == len(slots):
                    self.index.unpin([key])
                    continue
                try:
                    self.index.begin_host_fill(key, slots[len(taken)], count_access=False)
                except IndexStateError:  # filling already (another job): nothing to do
                    self.index.unpin([key])
                    continue
                taken.append(key)
            self.index.release_slots(slots[len(taken) :])
            if not taken:
                return None
            job = LoadJob(
                next(self._ids),
                tuple(taken),
                None,
                tuple(slots[: len(taken)]),
                (Tier.OBJECT,) * len(taken),
            )
            self._inflight[job.job_id] = job
            self._prefetch_jobs.add(job.job_id)
            self._background.append(job)
            self._stats["object_prefetch_jobs"] += 1
            self._stats["object_prefetch_started_blocks"] += len(taken)
            return job.job_id

    def prefetch_in_flight(self, job_id: int) -> bool:
        with self._lock:
            return job_id in self._prefetch_jobs

    def _complete_object_load(self, job: LoadJob, result: JobResult) -> bool:
        """Apply `job` if it is a prefetch or an object write-behind's staging read (True)."""
        if job.job_id not in self._prefetch_jobs:
            return super()._complete_object_load(job, result)
        self._prefetch_jobs.discard(job.job_id)
        for key in job.keys:
            reason = result.failed.get(key)
            if self.index.commit_host_fill(key, reason is None):
                self._event("stored", key, Tier.HOST)
            self._forget_lost_copy(key, Tier.OBJECT, reason)
            self.index.unpin([key])
            self._stats[
                "object_prefetch_blocks" if reason is None else "object_prefetch_failed_blocks"
            ] += 1
        return True
