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
remote_hits.py, bounded by `object_store_lookup_wait_s`), so the request holds no GPU
blocks during the network reads and its load, once scheduled, reads host memory. A block not
prefetched in time, or beyond the cap, is staged by the load itself (object -> host -> GPU) as
before. Every object read is verified by the tier (header and checksum); a block that fails is
not promoted, and a lost or bad copy is forgotten (the load recomputes it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from flexkv_py.coordinator.host_space import HostSpace
from flexkv_py.coordinator.jobs import Job, JobResult, LoadJob, read_into_host
from flexkv_py.coordinator.kv_events import EventQueue
from flexkv_py.coordinator.lost_copies import forget_lost_copy
from flexkv_py.coordinator.outbox import Outbox
from flexkv_py.index.entry import IndexStateError
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier


class ObjectPrefetch:
    """Every method runs under the manager's lock."""

    def __init__(
        self,
        index: TierIndex,
        host: HostSpace,
        outbox: Outbox,
        events: EventQueue,
        stats: Counter[str],
        *,
        cap: int,
    ) -> None:
        self._index = index
        self._host = host
        self._outbox = outbox
        self._events = events
        self._stats = stats
        self._cap = cap  # object_store_prefetch_blocks
        self._jobs: set[int] = set()  # in flight

    def start(self, keys: Sequence[bytes]) -> int | None:
        """Start moving `keys` (a matched run on the object tier, root first) object -> host;
        returns the job's id, None when nothing was started (see the module docstring)."""
        index = self._index
        room = min(self._cap, self._host.free_beyond_reserve(), len(keys))
        if room <= 0:
            return None
        located = index.acquire(keys[:room])  # pinned: not evicted nor dropped
        wanted = [k for k, at in zip(keys, located, strict=False) if at.tier is Tier.OBJECT]
        index.unpin([k for k, at in zip(keys, located, strict=False) if at.tier is not Tier.OBJECT])
        slots = index.allocate_slots(len(wanted))
        taken: list[bytes] = []
        for key in wanted:
            if len(taken) == len(slots):
                index.unpin([key])
                continue
            try:
                index.begin_host_fill(key, slots[len(taken)], count_access=False)
            except IndexStateError:  # filling already (another job): nothing to do
                index.unpin([key])
                continue
            taken.append(key)
        index.release_slots(slots[len(taken) :])
        if not taken:
            return None
        job = read_into_host(self._outbox.new_id(), taken, slots[: len(taken)], Tier.OBJECT)
        self._outbox.track(job, self._complete, background=True)
        self._jobs.add(job.job_id)
        self._stats["object_prefetch_jobs"] += 1
        self._stats["object_prefetch_started_blocks"] += len(taken)
        return job.job_id

    def in_flight(self, job_id: int) -> bool:
        return job_id in self._jobs

    def _complete(self, job: Job, result: JobResult) -> None:
        assert isinstance(job, LoadJob)
        self._jobs.discard(job.job_id)
        index = self._index
        for key in job.keys:
            reason = result.failed.get(key)
            if index.commit_host_fill(key, reason is None):
                self._events.add("stored", (key,), Tier.HOST)
            forget_lost_copy(index, self._events, self._stats, key, Tier.OBJECT, reason)
            index.unpin([key])
            self._stats[
                "object_prefetch_blocks" if reason is None else "object_prefetch_failed_blocks"
            ] += 1
