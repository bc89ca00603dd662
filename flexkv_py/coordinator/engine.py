"""In-process cache engine: manager + executor in one object (tests, CLI replay, benches).

The vLLM connector splits the two across processes; this facade wires them directly and runs
background jobs (spills, deletes) as they appear. Synchronous calls (`store`, `load`) wait for
their job; `submit_load` returns a handle whose `done()` never blocks.

Host-only paths (`store_pages` / `load_pages`) move bytes between the caller and host slots
without a GPU, for tools and tests that have no KV cache.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import Buffer

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.executor import ExecutorOptions, JobExecutor, JobHandle
from flexkv_py.coordinator.host_side import HostSlots, build_host_side, write_pages
from flexkv_py.coordinator.jobs import CACHED, MISSING, NO_SLOT, OK, JobResult, LoadJob
from flexkv_py.coordinator.manager import CacheManager
from flexkv_py.coordinator.pipeline import pipeline_parts
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.transfer.stream_order import Transfer

logger = logging.getLogger(__name__)

_NONE = "none"  # load source of a block that was not loadable
_HOST = Tier.HOST.value


# A load source's name, per block, without the enum's `.value` descriptor call.
def _source_name(tier: Tier | None) -> str:
    return _NONE if tier is None else tier.value


@dataclass(frozen=True)
class BlockOutcome:
    """Per-block result of a store or load: `statuses[i]` is "ok" (OK), "cached" (CACHED) or
    why not: a failure reason of coordinator/jobs.py, the same strings as JobResult.failed."""

    statuses: tuple[str, ...]
    source_tiers: tuple[str, ...] = ()  # load, per block: a Tier value ("host", "ssd") or "none"

    @property
    def num_ok(self) -> int:
        return sum(s == OK for s in self.statuses)

    @property
    def ok(self) -> bool:
        return {OK, CACHED}.issuperset(self.statuses)  # one C-level pass

    def failed_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.statuses) if s not in (OK, CACHED)]


class EngineHandle:
    """An engine job in flight: `done()` polls, `result()` waits and applies it to the index."""

    def __init__(
        self, engine: CacheEngine, keys: Sequence[bytes], handle: JobHandle | None, skipped: str
    ) -> None:
        self._engine = engine
        self._keys = tuple(keys)
        self._handle = handle
        # Keys the job does not carry get their status now: cached if known, else `skipped`.
        known = engine.manager.known
        taken = set(handle.job.keys) if handle is not None else set()
        self._skipped = {k: (CACHED if known(k) else skipped) for k in keys if k not in taken}
        self._outcome: BlockOutcome | None = None

    def done(self) -> bool:
        return self._handle is None or self._handle.done()

    def result(self, timeout: float | None = None) -> BlockOutcome:
        if self._outcome is None:
            failed: dict[bytes, str] = {}
            tiers: tuple[str, ...] = ()
            if self._handle is not None:
                failed = self._engine._finish(self._handle, timeout).failed
                if isinstance(self._handle.job, LoadJob):
                    tiers = tuple(map(_source_name, self._handle.job.sources))
            if not failed and not self._skipped:
                statuses: tuple[str, ...] = (OK,) * len(self._keys)  # the common case
            else:
                statuses = tuple(self._skipped.get(k) or failed.get(k, OK) for k in self._keys)
            self._outcome = BlockOutcome(statuses, tiers)
        return self._outcome


class CacheEngine:
    def __init__(
        self,
        config: FlexKVConfig,
        namespace: Namespace,
        host_pool: HostSlots,
        transfer: Transfer | None = None,
        *,
        executor: ExecutorOptions | None = None,
        owns: Sequence[Any] = (),
        free_target: float = 0.05,
    ) -> None:
        """`executor`: how to build the JobExecutor (its tiers, threads); default from config."""
        self.pool = host_pool
        self.executor = JobExecutor(
            config, namespace, host_pool, transfer, options=executor, owns=owns
        )
        self.manager = CacheManager(
            config,
            namespace,
            page_bytes=namespace.page_bytes or host_pool.slot_nbytes,
            num_host_slots=host_pool.num_slots,
            usable_host_slots=host_pool.ready_slots,
            free_target=free_target,
        )
        # In-process use captures no CUDA graphs of vLLM's: a background pool may pin at once.
        host_pool.allow_registration()
        self._bg: dict[int, JobHandle] = {}
        self._bg_lock = threading.Lock()
        self.manager.adopt_ssd_keys([self.executor.stored_keys()])
        self._pump()

    @classmethod
    def from_kv_caches(
        cls, config: FlexKVConfig, namespace: Namespace, kv_caches: Mapping[str, Any]
    ) -> CacheEngine:
        """Engine with a host pool and transfer engine built for these KV caches."""
        pool, transfer = build_host_side(config, namespace, kv_caches)
        return cls(config, namespace, pool, transfer, owns=(transfer, pool))

    # ------------------------------------------------------------------ plumbing
    def _pump(self) -> None:
        """Submit new background jobs; apply the results of finished ones (never blocks)."""
        self.manager.grow_host_slots(self.pool.ready_slots)
        for job in self.manager.take_jobs():
            handle = self.executor.submit(job)
            with self._bg_lock:
                self._bg[job.job_id] = handle
        with self._bg_lock:
            done = [j for j, h in self._bg.items() if h.done()]
            for j in done:
                del self._bg[j]
        for result in self.executor.wait(done):
            self.manager.complete(result)

    def _wait_background(self, kind: str | None = None) -> bool:
        """Wait for in-flight background jobs (of `kind`); True if there were any."""
        self._pump()
        with self._bg_lock:
            ids = [j for j, h in self._bg.items() if kind is None or h.job.kind == kind]
            for j in ids:
                del self._bg[j]
        for result in self.executor.wait(ids):
            self.manager.complete(result)
        return bool(ids)

    def _finish(self, handle: JobHandle, timeout: float | None, pump: bool = True) -> JobResult:
        result = handle.wait(timeout)
        if self.executor.wait([handle.job_id]):  # consumed here: ours alone to apply
            self.manager.complete(result)
        if pump:
            self._pump()
        return result

    # ------------------------------------------------------------------ API
    def lookup(self, keys: Sequence[bytes]) -> int:
        self._pump()
        return self.manager.lookup(keys)

    def lookup_object(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of a chain (`keys`, root first) the bucket holds, asked now (blocks
        on the network: tools and tests; the connector asks through tiers/object/lookups.py);
        the index learns them, so a `load` after it stages them from the object tier."""
        tier = self.executor.tiers.get(Tier.OBJECT)
        lookup_chain = getattr(tier, "lookup_chain", None)
        if lookup_chain is None:
            return 0
        count = int(lookup_chain(keys))
        self.manager.note_object_hits(keys, 0, count)
        return count

    def store(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int],
        timeout: float | None = None,
        *,
        parent: bytes | None = None,
    ) -> BlockOutcome:
        """Store GPU blocks; waits for in-flight spills when the host tier is short of slots.
        `parent`: the cached block keys[0] extends (prefix-aware eviction keeps it)."""
        return self._store(keys, gpu_block_ids, None, timeout, parent)

    def store_pages(
        self, keys: Sequence[bytes], pages: Sequence[Buffer], timeout: float | None = None
    ) -> BlockOutcome:
        """Host-only store: copy each page (bytes-like, <= slot size) into a host slot."""
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        return self._store(keys, None, pages, timeout)

    def _store(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        pages: Sequence[Buffer] | None,
        timeout: float | None,
        parent: bytes | None = None,
    ) -> BlockOutcome:
        statuses: dict[bytes, str] = {}
        handles: list[JobHandle] = []

        def finish(h: JobHandle) -> None:
            failed = self._finish(h, timeout).failed
            if failed:
                statuses.update((k, failed.get(k, OK)) for k in h.job.keys)
            else:
                statuses.update(dict.fromkeys(h.job.keys, OK))

        def finish_ours() -> bool:
            # Our finished fills become evictable, which lets the next round free slots.
            for h in handles:
                finish(h)
            had = bool(handles)
            handles.clear()
            return had

        todo = list(range(len(keys)))
        first_round = True  # the first round in parts (see pipeline_parts), retries whole
        while todo:  # every retry follows progress (a spill or a fill finished)
            self._pump()
            bounds = pipeline_parts(len(todo)) if first_round else [(0, len(todo))]
            first_round = False
            in_jobs: set[bytes] = set()
            for start, end in bounds:
                part = todo[start:end]
                lo, hi = part[0], part[-1] + 1
                if hi - lo == len(part):  # a run of the request's blocks (the first round): slices
                    part_keys = list(keys[lo:hi])
                    gpu = None if gpu_block_ids is None else list(gpu_block_ids[lo:hi])
                    parents = [keys[lo - 1] if lo else parent, *keys[lo : hi - 1]]
                else:
                    part_keys = [keys[i] for i in part]
                    gpu = None if gpu_block_ids is None else [gpu_block_ids[i] for i in part]
                    parents = [keys[i - 1] if i else parent for i in part]  # keys form a chain
                job = self.manager.prepare_store(part_keys, gpu, parents=parents)
                if job is not None:
                    in_jobs.update(job.keys)
                    fill = None
                    if pages is not None:
                        by_key = {keys[i]: pages[i] for i in part}
                        fill = functools.partial(write_pages, self.pool, job, by_key)
                    handles.append(self.executor.submit(job, fill))
                    if len(handles) > 1:  # its completion overlaps the copy just submitted
                        finish(handles.pop(0))
            # Neither in a job now nor cached by someone else: found no free host slot.
            if len(in_jobs) == len(todo):  # every block is in a job (the common case)
                todo = []
            else:
                todo = [i for i in todo if keys[i] not in in_jobs]
                known = self.manager.index.known_many([keys[i] for i in todo])
                todo = [i for i, k in zip(todo, known, strict=True) if not k]
            if todo and not (self._wait_background("spill") or finish_ours()):
                break
        for i in todo:
            statuses[keys[i]] = NO_SLOT
        finish_ours()
        return BlockOutcome(tuple(map(statuses.get, keys, itertools.repeat(CACHED, len(keys)))))

    def submit_load(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int] | None
    ) -> EngineHandle:
        self._pump()
        job = self.manager.prepare_load(keys, gpu_block_ids)
        handle = self.executor.submit(job) if job else None
        self._pump()
        return EngineHandle(self, keys, handle, MISSING)

    def load(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int], timeout: float | None = None
    ) -> BlockOutcome:
        """Load blocks into GPU blocks; per-block status ("ok" or why not). A load served from
        host memory runs in parts (see pipeline_parts): each part is pinned while the part
        before copies, and completed while the part after copies; its copies are issued in
        this thread and its completion runs here too (executor.submit's `here`). Once a part
        reaches a lower tier (or misses), the rest of the load is one job."""
        if len(gpu_block_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU block ids")
        self._pump()
        statuses: list[str] = []
        tiers: list[str] = []

        def finish(handle: JobHandle, pump: bool = True) -> None:
            failed = self._finish(handle, timeout, pump).failed
            job = handle.job
            assert isinstance(job, LoadJob)
            if failed:
                statuses.extend(failed.get(k, OK) for k in job.keys)
            else:
                statuses.extend((OK,) * len(job.keys))
            if job.all_from_host:  # no per-block pass (the last part's is after the last copy)
                tiers.extend((_HOST,) * len(job.keys))
            else:
                tiers.extend(map(_source_name, job.sources))

        running: JobHandle | None = None  # the part whose copy runs now
        start = 0
        for part_start, part_end in pipeline_parts(len(keys)):
            if part_start < start:
                continue  # in the previous job already (it took the rest of the load)
            try:
                job = self.manager.prepare_load_part(
                    keys[start:], gpu_block_ids[start:], part_end - start
                )
                assert job is not None  # keys[start:] is not empty
                # A part from host memory: copies issued here, completed by our wait.
                handle = self.executor.submit(job, here=True)
            except BaseException:
                if running is not None:  # applied (its pins released) before the error goes up
                    finish(running)
                raise
            if running is not None:
                finish(running)  # its completion overlaps this part's copy
            running, start = handle, start + len(job.keys)
        if running is not None:
            finish(running, pump=False)  # the next call pumps: nothing waits on it after a load
        return BlockOutcome(tuple(statuses), tuple(tiers))

    def load_pages(self, keys: Sequence[bytes], timeout: float | None = None) -> list[bytes | None]:
        """Host-only load: each block's slot bytes, or None if it could not be loaded. Lower-tier
        blocks each need a host slot here (nothing streams): fewer free ones than blocks load in
        several jobs, each read before the next."""
        self._pump()
        out: list[bytes | None] = []
        rest = list(keys)
        while rest:
            job = self.manager.prepare_load(rest, None, in_rounds=True)
            assert job is not None  # None only for no keys
            result = self.executor.submit(job).wait(timeout)
            tensor = self.pool.tensor  # type: ignore[attr-defined]
            # Read while the blocks are still pinned (complete releases them).
            out += [
                None if k in result.failed else tensor[s].numpy().tobytes()
                for k, s in zip(job.keys, job.host.slots, strict=True)
            ]
            if self.executor.wait([job.job_id]):
                self.manager.complete(result)
            self._pump()
            rest = rest[len(job.keys) :]
        return out

    def flush(self) -> None:
        """Wait until every background job (spills, deletes) is done and applied."""
        while self._wait_background():
            pass

    def flush_write_behind(self, timeout_s: float = 5.0, tier: Tier | None = None) -> int:
        """Best effort, at most `timeout_s`: write every host block still owed to `tier` (None:
        the spill tier) (shutdown; ignores the write-behind rate). Returns how many are still
        owed."""
        deadline = time.monotonic() + timeout_s
        mgr = self.manager
        while (left := deadline - time.monotonic()) > 0:
            job = mgr.take_write_behind(drain=True, tier=tier)
            if job is None and self._wait_background("spill"):
                continue  # one was in flight already (taken by the background pump)
            if job is None:
                break
            handle = self.executor.submit(self.manager.take_jobs_now(job))
            try:
                result = handle.wait(left)
            except TimeoutError:
                break  # still running: shutdown leaves it to finish (or time out) on its own
            if self.executor.wait([job.job_id]):
                self.manager.complete(result)
        return mgr.write_behind_pending(tier)

    def reset(self) -> None:
        """Forget every block, host and lower tiers (e.g. new weights under the same model name)."""
        drop = self.manager.reset()
        if drop is not None:
            self.executor.submit(drop)
            for result in self.executor.wait([drop.job_id]):  # the cold blocks it deleted
                self.manager.complete(result)

    def stats(self) -> dict[str, Any]:
        self._pump()
        return {"manager": self.manager.stats(), "executor": self.executor.stats()}

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Finish background jobs, write what the SSD is still owed (bounded), shut down."""
        self.flush()
        for writer in self.manager.writers:  # the spill tier's first
            self.flush_write_behind(flush_timeout_s, writer.tier)
        self.executor.shutdown()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
