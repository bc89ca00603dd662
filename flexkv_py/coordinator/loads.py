"""Load planning: pin a request's cached blocks, stage lower-tier ones through host slots (and
keep them there: promoted), and apply the load's result. A load with more lower-tier blocks than
the staging slots it can get streams through them in rounds (read, host->GPU copy, reuse; only
the last round stays promoted). A block that is no longer cached, or has no host slot at all to
stage through, is in the job as missing so the worker reports it failed; a lower-tier copy
that turns out lost or bad is forgotten."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from flexkv_py.coordinator.drain_admitted import DrainAdmitted
from flexkv_py.coordinator.host_space import HostSpace, spill_of
from flexkv_py.coordinator.jobs import Job, JobResult, LoadJob, load_job
from flexkv_py.coordinator.kv_events import EventQueue
from flexkv_py.coordinator.legs import Blocks, Gpu, Host
from flexkv_py.coordinator.lost_copies import forget_lost_copy
from flexkv_py.coordinator.outbox import Outbox
from flexkv_py.index.entry import IndexStateError, Located, Victim
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier


class LoadPlanner:
    """Every method runs under the manager's lock."""

    def __init__(
        self,
        index: TierIndex,
        host: HostSpace,
        drain: DrainAdmitted,
        outbox: Outbox,
        events: EventQueue,
        stats: Counter[str],
        *,
        page_bytes: int,
    ) -> None:
        self._index = index
        self._host = host
        self._drain = drain
        self._outbox = outbox
        self._events = events
        self._stats = stats
        self._page_bytes = page_bytes

    def prepare_load(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        *,
        in_rounds: bool = False,
    ) -> LoadJob | None:
        """A job loading `keys` into `gpu_block_ids`. Blocks are pinned until `complete`. A block
        that is no longer cached (or has no host slot to stage through) is in the job as
        missing so the worker reports it failed; None only for an empty request.
        `in_rounds` (a host-only load whose caller loads the rest later): the job may carry
        only a prefix of `keys`, ending before a lower-tier block with no slot of its own."""
        if gpu_block_ids is not None and len(gpu_block_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU block ids")
        if not keys:
            return None
        job = self._host_load(keys, gpu_block_ids)
        if job is not None:
            return job
        acquired = self._index.acquire(keys, count_hits=True)
        return self._plan_load(keys, gpu_block_ids, acquired, in_rounds=in_rounds)

    def prepare_load_part(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int] | None, end: int
    ) -> LoadJob | None:
        """The next part of a load run in parts (engine.py): `keys` are the load's blocks not
        yet in a job. A job of keys[:end] when every one of them is in host memory (pinned
        now, while the part before still copies); otherwise one job of all `keys` (lower-tier
        blocks stage through slots whose spills must come first, and a miss ends the load
        there, as `prepare_load` does). None only for an empty request."""
        if gpu_block_ids is not None and len(gpu_block_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU block ids")
        if not keys:
            return None
        job = self._host_load(keys[:end], None if gpu_block_ids is None else gpu_block_ids[:end])
        if job is not None:
            return job
        acquired = self._index.acquire(keys[:end], count_hits=True)
        if len(acquired) == end and end < len(keys):
            acquired += self._index.acquire(keys[end:], count_hits=True)
        return self._plan_load(keys, gpu_block_ids, acquired)

    def _host_load(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int] | None
    ) -> LoadJob | None:
        """The common case (lock held): every block is in host memory, pinned and its slot
        taken in one index call (no `Located` per block). None, nothing pinned, otherwise."""
        slots = self._index.acquire_host(keys, count_hits=True)
        if slots is None:
            return None
        n = len(keys)
        self._drain.note(keys, stored=False)
        return self._new_load_job(keys, gpu_block_ids, slots, None, [False] * n, [])

    def _plan_load(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        acquired: list[Located],
        *,
        in_rounds: bool = False,
    ) -> LoadJob:
        """The job of `prepare_load` once its leading blocks are pinned (`acquired`, lock
        held), when not every block is in host memory (that case: `_host_load`)."""
        host = Tier.HOST
        n_lower = sum(t.tier is not host for t in acquired)
        chained: list[Victim] = []
        staging = self._host.take_slots(n_lower, chained) if n_lower else []
        if in_rounds and gpu_block_ids is None and 0 < len(staging) < n_lower:
            # Host-only: its caller reads every slot after the job, so a lower-tier block
            # needs a slot of its own. The job ends before the first one without; the
            # caller loads the rest in a later job (`CacheEngine.load_pages`). A lookup
            # promised them counting one shared staging slot, as a GPU load streams.
            lower = [i for i, t in enumerate(acquired) if t.tier is not host]
            cut = lower[len(staging)]
            # Loaded (and counted) in that later job, not this one.
            self._index.unpin(list(keys[cut : len(acquired)]), uncount_hits=True)
            keys, acquired, n_lower = keys[:cut], acquired[:cut], len(staging)
        self._drain.note(keys[: len(acquired)], stored=False)
        # Fewer staging slots than lower-tier blocks: the load streams through them in
        # rounds (job_bodies.py), lower-tier block j in slot j mod n; only each slot's
        # last block stays in host (promoted).
        # Not a host-only load: its caller reads every slot after the job.
        stream = bool(staging) and gpu_block_ids is not None
        through = n_lower - len(staging) if stream else 0
        sources: list[Tier | None] = []
        slots: list[int] = []
        promoted: list[bool] = []
        j = 0  # lower-tier blocks seen
        for i, key in enumerate(keys):
            src: Tier | None = None
            slot, promote = -1, False
            if i < len(acquired):
                got = acquired[i]
                if got.tier is host:
                    assert got.host_slot is not None
                    src, slot = host, got.host_slot
                elif j < len(staging) or stream:
                    src, slot = got.tier, staging[j % len(staging)]
                    j += 1
                    if j > through:
                        try:
                            self._index.begin_host_fill(key, slot, count_access=False)
                            promote = True
                        except IndexStateError:
                            pass  # another job is filling its host copy: stage only
                else:  # no staging slot: cannot load
                    self._index.unpin([key])
                    self._stats["load_no_slot_blocks"] += 1
            sources.append(src)
            slots.append(slot)
            promoted.append(promote)
        self._stats["load_streamed_blocks"] += through
        self._stats["load_missing_blocks"] += len(keys) - len(acquired)
        return self._new_load_job(keys, gpu_block_ids, slots, sources, promoted, chained)

    def prepare_load_parts(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        bounds: Sequence[tuple[int, int]],
    ) -> list[LoadJob]:
        """`prepare_load`, split at `bounds` into jobs the caller submits one after the other
        (their copies queue while the next is submitted, their completions overlap the next
        copies). Every block is pinned before the first part runs. Only a load served wholly
        from host memory is split: lower-tier blocks stage through slots whose spills must come
        first."""
        job = self.prepare_load(keys, gpu_block_ids)
        if job is None:
            return []
        if len(bounds) < 2 or job.spill.keys or job.drop_first or not job.all_from_host:
            return [job]
        self._outbox.forget(job.job_id)
        keys, slots, gpu = job.keys, job.host.slots, job.gpu
        parts = []
        for start, end in bounds:  # every block in host memory: no reads, nothing missing
            part = LoadJob(
                self._outbox.new_id(),
                Blocks(keys[start:end]),
                Host(slots[start:end]),
                None if gpu is None else Gpu(gpu.ids[start:end]),
            )
            self._track(part, [False] * (end - start))
            parts.append(part)
        return parts

    def _new_load_job(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        slots: Sequence[int],
        sources: Sequence[Tier | None] | None,
        promoted: list[bool],
        chained: list[Victim],
    ) -> LoadJob:
        """Register a load job whose blocks are pinned (lock held); `sources` None: all in host
        memory."""
        job = load_job(
            self._outbox.new_id(),
            keys,
            gpu_block_ids,
            slots,
            sources,
            spill=spill_of(chained, self._host.spill_tier),
            drop_first=self._host.take_drops(),  # room the index made for the spills (eviction.py)
        )
        self._track(job, promoted)
        self._host.keep_reserve()
        return job

    def _track(self, job: LoadJob, promoted: list[bool]) -> None:
        """Register a load job: its result comes back with `promoted` (block i: a host fill
        was begun, the lower-tier block stays in host)."""

        def loaded(job: Job, result: JobResult) -> None:
            assert isinstance(job, LoadJob)
            self._host.complete_chained(job, result)
            self._complete(job, result, promoted)

        self._outbox.track(job, loaded)

    def _complete(self, job: LoadJob, result: JobResult, promoted: list[bool]) -> None:
        failed = result.failed
        if not failed and job.all_from_host:
            # The common case, in one pass: every block came from host memory and loaded.
            self._index.unpin(job.keys)
            self._stats["load_host_blocks"] += len(job.keys)
            self._stats["load_host_bytes"] += self._page_bytes * len(job.keys)
            return
        # Staging slots no promoted block keeps, each once (a streamed load reuses them).
        slots = job.host.slots
        kept = {slots[i] for i, p in enumerate(promoted) if p}
        staged = {s for read in job.reads for s in read.dst.places() or ()}
        self._index.release_slots(staged - kept)
        sources = job.sources
        for i, key in enumerate(job.keys):
            src = sources[i]
            if src is None:
                self._stats["load_failed_blocks"] += 1
                continue
            reason = failed.get(key)
            if src is not Tier.HOST:
                if promoted[i] and self._index.commit_host_fill(key, reason is None):
                    self._events.add("stored", (key,), Tier.HOST)
                forget_lost_copy(self._index, self._events, self._stats, key, src, reason)
            self._index.unpin([key])
            if reason is None:
                self._stats[f"load_{src.value}_blocks"] += 1
                self._stats[f"load_{src.value}_bytes"] += self._page_bytes
            else:
                self._stats["load_failed_blocks"] += 1
