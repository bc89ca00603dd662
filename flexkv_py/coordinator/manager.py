"""Scheduler side: decides where blocks go and emits jobs; never touches block memory.

Model: vLLM's kv_offload manager. `lookup` answers from the tier index; `prepare_store` and
`prepare_load` pin what they use and return a job for every worker; background work (host->SSD
spills on eviction, SSD deletes) comes out of `take_jobs`; `complete` applies a job's (merged)
result. Nothing a job still uses can be evicted or reused: stores pin their fresh slots, loads pin
their blocks, and a spilled slot is free only once its SSD write is confirmed.

Host space policy: a job that needs slots takes free ones first, then evicts per policy. A victim
that must reach SSD first (write-back) travels inside the job (`spill_keys`): the worker writes it
out before reusing its slot. To keep that off the critical path the manager also keeps
`free_target` of the slots free-or-spilling with background SpillJobs. When every slot is pinned,
a store is cut at the end (the earliest blocks of a prefix are the valuable ones) and a load
reports the blocks it cannot stage as failed.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.jobs import (
    CORRUPT,
    IO_ERROR,
    IO_TIMEOUT,
    NOT_FOUND,
    DropJob,
    Job,
    JobResult,
    LoadJob,
    SpillJob,
    StoreJob,
)
from flexkv_py.coordinator.planning import host_slots_for
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.policies import AdmissionPolicy, make_eviction_policy
from flexkv_py.index.tier_index import IndexStateError, TierIndex, Victim
from flexkv_py.index.tier_names import Tier

logger = logging.getLogger(__name__)

# SSD read failures that mean "this copy is gone or bad": the index forgets the SSD copy.
# A timed-out read (a stuck device, see late_io.py) too: kept, every lookup would promise it
# again and every retry fail at once on fenced slots, a loop of load errors; forgotten, the
# block is recomputed and stored again.
_SSD_COPY_LOST = frozenset({NOT_FOUND, CORRUPT, IO_ERROR, IO_TIMEOUT})


@dataclass(frozen=True)
class KVEvent:
    """A block appeared in / left a tier (vLLM BlockStored / BlockRemoved for Dynamo's router)."""

    kind: Literal["stored", "removed"]
    block_hash: bytes
    medium: Literal["CPU", "SSD"]


@dataclass
class _LoadPlan:
    promoted: list[bool]  # block i: a host fill was begun (SSD block becomes host-resident)


class CacheManager:
    def __init__(
        self,
        config: FlexKVConfig,
        namespace: Namespace,
        page_bytes: int,
        *,
        num_host_slots: int | None = None,
        usable_host_slots: int | None = None,
        free_target: float = 0.05,
        max_events: int = 100_000,
    ) -> None:
        """`page_bytes`: one block of one rank (all layers, K and V). `num_host_slots` overrides
        the count planned from cpu_cache_gb (it must equal every worker's pool).
        `usable_host_slots`: slots usable now (default all); the rest arrive through
        `grow_host_slots` as the workers' pools are prepared in the background."""
        self.config = config
        self.namespace = namespace
        self.page_bytes = page_bytes
        slots = (
            num_host_slots
            if num_host_slots is not None
            else (host_slots_for(config, namespace, page_bytes))
        )
        self.index = TierIndex(
            slots, make_eviction_policy(config.eviction_policy), usable_host_slots=usable_host_slots
        )
        self.admission = AdmissionPolicy(config.admission_spec)
        self.ssd_enabled = config.ssd_enabled
        self._free_target = min(slots, math.ceil(free_target * slots))
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._inflight: dict[int, Job] = {}
        self._load_plans: dict[int, _LoadPlan] = {}
        self._spilling = 0  # slots held by in-flight spills
        self._spill_batch: list[Victim] = []
        self._background: list[Job] = []
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._stats: Counter[str] = Counter()

    @property
    def num_host_slots(self) -> int:
        return self.index.num_host_slots

    # ------------------------------------------------------------------ queries
    def known(self, key: bytes) -> bool:
        """The block is cached in some tier or being stored by a job (not to be stored again)."""
        return self.index.known(key)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys readable from some tier (host, SSD)."""
        hit = self.index.readable_prefix(keys)
        self.count_lookup(hit)
        return hit

    def readable_hashes(self, head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """Index of the first unreadable key head + hashes[i] in [start, stop) (stop if none),
        without building the keys (the scheduler's lookup). Counts no lookup: the caller calls
        `count_lookup` once per attempt."""
        return self.index.readable_hashes(head, hashes, start, stop)

    def count_lookup(self, hit: int) -> None:
        with self._lock:
            self._stats["lookups"] += 1
            self._stats["lookup_hit_blocks"] += hit

    # ------------------------------------------------------------------ stores
    def prepare_store(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int] | None
    ) -> StoreJob | None:
        """A job copying the not-yet-cached blocks into fresh host slots (and, write-through, to
        SSD). Keys already cached or in flight are skipped; None when nothing is left to do."""
        if gpu_block_ids is not None and len(gpu_block_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU block ids")
        with self._lock:
            todo: list[int] = []
            seen: set[bytes] = set()
            for i, key in enumerate(keys):
                if key in seen or self.index.known(key):
                    self._stats["store_skipped_cached"] += 1
                    continue
                seen.add(key)
                todo.append(i)
            chained: list[Victim] = []
            slots = self._take_slots(len(todo), chained) if todo else []
            if len(slots) < len(todo):
                self._stats["store_skipped_no_slot"] += len(todo) - len(slots)
                todo = todo[: len(slots)]
            job = None
            if todo:
                self.index.begin_host_fills([keys[i] for i in todo], slots)
                to_ssd, neither = (Tier.SSD,), ()
                write_tiers = [
                    to_ssd
                    if self.ssd_enabled
                    and self.admission.admit_on_store(self.index.hits(keys[i]))
                    and self.index.begin_ssd_write(keys[i])
                    else neither
                    for i in todo
                ]
                job = StoreJob(
                    job_id=next(self._ids),
                    keys=tuple(keys[i] for i in todo),
                    gpu_block_ids=(
                        None if gpu_block_ids is None else tuple(gpu_block_ids[i] for i in todo)
                    ),
                    host_slots=tuple(slots),
                    write_tiers=tuple(write_tiers),
                    spill_keys=tuple(v.key for v in chained),
                    spill_slots=tuple(v.host_slot for v in chained),
                )
                self._inflight[job.job_id] = job
            self._keep_reserve()
            return job

    # ------------------------------------------------------------------ loads
    def prepare_load(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int] | None
    ) -> LoadJob | None:
        """A job loading `keys` into `gpu_block_ids`. Blocks are pinned until `complete`. A block
        that is no longer cached (or has no host slot to stage through) is in the job with
        source "none" so the worker reports it failed; None only for an empty request."""
        if gpu_block_ids is not None and len(gpu_block_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU block ids")
        if not keys:
            return None
        with self._lock:
            acquired = self.index.acquire(keys, count_hits=True)
            if len(acquired) == len(keys) and all(a.tier is Tier.HOST for a in acquired):
                # The common case, in one pass: every block is in host memory.
                return self._new_load_job(
                    keys,
                    gpu_block_ids,
                    [a.host_slot for a in acquired],  # type: ignore[misc]
                    (Tier.HOST,) * len(keys),
                    [False] * len(keys),
                    [],
                )
            n_ssd = sum(t.tier is Tier.SSD for t in acquired)
            chained: list[Victim] = []
            staging = self._take_slots(n_ssd, chained) if n_ssd else []
            sources: list[Tier | None] = []
            slots: list[int] = []
            promoted: list[bool] = []
            for i, key in enumerate(keys):
                src: Tier | None = None
                slot, promote = -1, False
                if i < len(acquired):
                    got = acquired[i]
                    if got.tier is Tier.HOST:
                        assert got.host_slot is not None
                        src, slot = Tier.HOST, got.host_slot
                    elif got.tier is Tier.SSD and staging:
                        src, slot = Tier.SSD, staging.pop()
                        try:
                            self.index.begin_host_fill(key, slot, count_access=False)
                            promote = True
                        except IndexStateError:
                            promote = False  # another job is filling its host copy: stage only
                    else:  # no staging slot (or object tier, not implemented): cannot load
                        self.index.unpin([key])
                        self._stats["load_no_slot_blocks"] += 1
                sources.append(src)
                slots.append(slot)
                promoted.append(promote)
            assert not staging, "every staging slot goes to an SSD block of this job"
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
        from host memory is split: SSD blocks stage through slots whose spills must come first.
        """
        with self._lock:
            job = self.prepare_load(keys, gpu_block_ids)
            if job is None:
                return []
            if len(bounds) < 2 or job.spill_keys or not job.all_from_host:
                return [job]
            del self._inflight[job.job_id]
            del self._load_plans[job.job_id]
            ids = job.gpu_block_ids
            parts = []
            for start, end in bounds:
                part = LoadJob(
                    job_id=next(self._ids),
                    keys=job.keys[start:end],
                    gpu_block_ids=None if ids is None else ids[start:end],
                    host_slots=job.host_slots[start:end],
                    sources=job.sources[start:end],
                )
                self._inflight[part.job_id] = part
                self._load_plans[part.job_id] = _LoadPlan([False] * (end - start))
                parts.append(part)
            return parts

    def _new_load_job(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        slots: Sequence[int],
        sources: Sequence[Tier | None],
        promoted: list[bool],
        chained: list[Victim],
    ) -> LoadJob:
        """Register a load job whose blocks are pinned (lock held)."""
        job = LoadJob(
            job_id=next(self._ids),
            keys=tuple(keys),
            gpu_block_ids=None if gpu_block_ids is None else tuple(gpu_block_ids),
            host_slots=tuple(slots),
            sources=tuple(sources),
            spill_keys=tuple(v.key for v in chained),
            spill_slots=tuple(v.host_slot for v in chained),
        )
        self._inflight[job.job_id] = job
        self._load_plans[job.job_id] = _LoadPlan(promoted)
        self._keep_reserve()
        return job

    # ------------------------------------------------------------------ eviction
    def _take_slots(self, n: int, chained: list[Victim]) -> list[int]:
        """Up to n slots for a job, evicting host blocks as needed. A victim that must reach SSD
        first is appended to `chained`: the job writes it out before reusing its slot."""
        slots = self.index.allocate_slots(n)
        while len(slots) < n:
            victim = self.index.begin_evict()
            if victim is None:
                break
            if self._needs_spill(victim):
                chained.append(victim)
                self.index.finish_evict(victim.key)  # pending SSD write only: not readable
                self._event("removed", victim.key, "CPU")
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
        """Should this victim reach SSD before its slot is reused? Marks the write in flight."""
        return (
            self.ssd_enabled
            and not v.on_ssd
            and self.admission.admit_on_evict(v.hits)
            and self.index.begin_ssd_write(v.key)
        )

    def _drop(self, v: Victim) -> None:
        self.index.finish_evict(v.key)
        self._event("removed", v.key, "CPU")
        self._stats["host_evicted_blocks"] += 1

    def _evict(self, v: Victim) -> None:
        """Background eviction: spill (slot freed when the SpillJob completes) or drop."""
        if self._needs_spill(v):
            self._spill_batch.append(v)
            self._spilling += 1
        else:
            self._drop(v)

    def _complete_chained(self, job: StoreJob | LoadJob, result: JobResult) -> None:
        for key in job.spill_keys:
            ok = key not in result.spill_failed
            self.index.commit_ssd_write(key, ok)
            if ok:
                self._stats["spilled_blocks"] += 1
                if self.index.on_ssd_readable(key):  # not reset while it was written
                    self._event("stored", key, "SSD")
            else:
                self._stats["spill_failed_blocks"] += 1

    def _flush_spills(self) -> None:
        if not self._spill_batch:
            return
        job = SpillJob(
            job_id=next(self._ids),
            keys=tuple(v.key for v in self._spill_batch),
            host_slots=tuple(v.host_slot for v in self._spill_batch),
        )
        self._spill_batch = []
        self._inflight[job.job_id] = job
        self._background.append(job)

    def take_jobs(self) -> list[Job]:
        """Background jobs (spills, SSD deletes) for every worker, in creation order."""
        with self._lock:
            self._flush_spills()
            jobs, self._background = self._background, []
            return jobs

    # ------------------------------------------------------------------ completion
    def complete(self, result: JobResult) -> None:
        """Apply a job's result (merged over ranks): commit or drop blocks, unpin, free slots."""
        with self._lock:
            job = self._inflight.pop(result.job_id, None)
            if job is None:
                logger.warning("result for unknown or finished job %d ignored", result.job_id)
                return
            if isinstance(job, StoreJob):
                self._complete_chained(job, result)
                self._complete_store(job, result)
            elif isinstance(job, LoadJob):
                self._complete_chained(job, result)
                self._complete_load(job, result, self._load_plans.pop(job.job_id))
            elif isinstance(job, SpillJob):
                self._complete_spill(job, result)
            for key in self.index.set_ssd(result.evicted_from(Tier.SSD), False):
                self._event("removed", key, "SSD")
                self._stats["ssd_evicted_blocks"] += 1
            garbage = self.index.take_garbage()
            if garbage:
                self._background.append(DropJob(next(self._ids), tuple(garbage)))
            self._keep_reserve()

    def _complete_store(self, job: StoreJob, result: JobResult) -> None:
        failed = result.failed
        ssd_positions = job.writes_to(Tier.SSD)
        if ssd_positions:
            ssd_failed = result.write_failed_on(Tier.SSD)
            for key in (job.keys[i] for i in ssd_positions):
                ssd_ok = key not in failed and key not in ssd_failed
                self.index.commit_ssd_write(key, ssd_ok)
                if ssd_ok:
                    self._stats["ssd_written_blocks"] += 1
                    if self.index.on_ssd_readable(key):  # not reset while it was written
                        self._event("stored", key, "SSD")
                else:
                    self._stats["ssd_write_failed_blocks"] += 1
        oks = [key not in failed for key in job.keys]
        # Announced: the blocks readable now (not those reset while they were stored).
        readable = self.index.commit_host_fills(job.keys, oks)
        block_hash = self.namespace.block_hash
        self._events.extend(KVEvent("stored", block_hash(k), "CPU") for k in readable)
        num_ok = sum(oks)
        self._stats["stored_blocks"] += num_ok
        self._stats["store_failed_blocks"] += len(job.keys) - num_ok

    def _complete_load(self, job: LoadJob, result: JobResult, plan: _LoadPlan) -> None:
        failed = result.failed
        if not failed and job.all_from_host:
            # The common case, in one pass: every block came from host memory and loaded.
            self.index.unpin(job.keys)
            self._stats["load_host_blocks"] += len(job.keys)
            self._stats["load_host_bytes"] += self.page_bytes * len(job.keys)
            return
        for i, key in enumerate(job.keys):
            src = job.sources[i]
            if src is None:
                self._stats["load_failed_blocks"] += 1
                continue
            reason = failed.get(key)
            if src is Tier.SSD:
                if plan.promoted[i]:
                    if self.index.commit_host_fill(key, reason is None):
                        self._event("stored", key, "CPU")
                else:
                    self.index.release_slots([job.host_slots[i]])
                if reason in _SSD_COPY_LOST:
                    # Never trust this SSD copy again (not found, corrupt or unreadable).
                    if self.index.set_ssd([key], False):
                        self._event("removed", key, "SSD")
                    self._stats[f"ssd_read_{reason}_blocks"] += 1
            self.index.unpin([key])
            if reason is None:
                self._stats[f"load_{src.value}_blocks"] += 1
                self._stats[f"load_{src.value}_bytes"] += self.page_bytes
            else:
                self._stats["load_failed_blocks"] += 1

    def _complete_spill(self, job: SpillJob, result: JobResult) -> None:
        for key in job.keys:
            ok = key not in result.failed
            self.index.commit_ssd_write(key, ok)
            self.index.finish_evict(key)
            self._event("removed", key, "CPU")
            if ok:
                self._stats["spilled_blocks"] += 1
                if self.index.on_ssd_readable(key):  # not reset while it was written
                    self._event("stored", key, "SSD")
            else:
                self._stats["spill_failed_blocks"] += 1
        self._spilling -= len(job.keys)

    # ------------------------------------------------------------------ inventory / reset
    def adopt_ssd_keys(self, keys_per_rank: Sequence[Collection[bytes]]) -> int:
        """Restart: index the blocks every rank's SSD tier holds (from JobExecutor.stored_keys).
        Blocks only some ranks hold are useless and get deleted. Returns how many were adopted."""
        with self._lock:
            owned = [{k for k in ks if self.namespace.owns(k)} for ks in keys_per_rank]
            if not owned:
                return 0
            common = set.intersection(*owned)
            orphans = set.union(*owned) - common
            adopted = self.index.set_ssd(sorted(common), True)
            for key in adopted:
                self._event("stored", key, "SSD")
            if orphans:
                self._background.append(DropJob(next(self._ids), tuple(sorted(orphans))))
            self._stats["ssd_adopted_blocks"] += len(adopted)
            logger.info("adopted %d SSD blocks (%d orphans dropped)", len(adopted), len(orphans))
            return len(adopted)

    def reset(self) -> DropJob | None:
        """Forget every block (e.g. after a weight update). Blocks in use by in-flight jobs become
        unreadable now and are cleaned up when their jobs complete. Returns the SSD deletes."""
        with self._lock:
            removed = self.index.reset()
            drop: list[bytes] = []
            # Newest first (insertion order reversed): a chain's blocks mostly leave from its
            # tail, as a router's prefix tree prefers (a parent stored again after its children,
            # or a block still in use, can come out of order).
            for key, entry in reversed(removed):
                if entry.host_slot is not None:
                    self._event("removed", key, "CPU")
                if entry.on_ssd:
                    self._event("removed", key, "SSD")
                    drop.append(key)
            self._stats["resets"] += 1
            if not drop:
                return None
            job = DropJob(next(self._ids), tuple(drop))
            return job

    # ------------------------------------------------------------------ events / stats
    def _event(
        self, kind: Literal["stored", "removed"], key: bytes, medium: Literal["CPU", "SSD"]
    ) -> None:
        self._events.append(KVEvent(kind, self.namespace.block_hash(key), medium))

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
            return events

    def inflight_job_ids(self, kind: str | None = None) -> list[int]:
        with self._lock:
            return [j for j, job in self._inflight.items() if kind is None or job.kind == kind]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
            out.update({f"index_{k}": v for k, v in self.index.counts().items()})
            out["host_slots"] = self.num_host_slots
            out["inflight_jobs"] = len(self._inflight)
            out["spilling_slots"] = self._spilling
            return out

    def close(self) -> None:
        """Nothing to release: the manager holds no memory or files."""
