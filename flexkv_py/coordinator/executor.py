"""Worker side: runs the manager's jobs on this rank's host pool, lower tiers and GPU KV cache.

This module is the job registry (submit, poll, wait, abandon, shutdown, stats), and picks each
job's body by its purpose (`kind`). What the jobs do is in job_bodies.py, which moves their
legs through the handler registry (leg_handlers.py, `JobExecutor.handlers`); deletes (a
DropJob, a job's `drop_first`) are legs to `Gone` through the same registry, beside what no leg
names (fingerprints, a namespace wipe), in drop_bodies.py; when a store stops reading GPU
blocks is in gpu_reads.py; bounded lower-tier waits in late_io.py; copy ordering in
transfer/stream_order.py; building the host pool and transfer engine in host_side.py.
The lower tiers are `LowerTier`s (tiers/protocol.py) in `tiers`, keyed by `Tier`.

Ordering: a store's GPU->host copy is submitted in the caller's thread inside `submit`, so it is
ordered after the model work already queued on the caller's CUDA stream; everything that follows
(waiting, lower-tier I/O, host->GPU copies) runs on a small thread pool, except for a load from
host memory submitted with `here` (CacheEngine.load): its copies are issued in the caller's
thread and the caller that waits for it completes it (_HereLoad). A DropJob, and any job's
`drop_first`, run inside `submit`, so a delete happens before any job submitted after it. Jobs
never reuse a slot another in-flight job uses: the manager guarantees that with pins.

Every job completes, and every block that did not make it is reported in its JobResult; an
unexpected exception fails all blocks of the job rather than leaving them unreported.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.gpu_reads import GpuReads
from flexkv_py.coordinator.host_side import HostSlots, build_host_side
from flexkv_py.coordinator.job_bodies import JobBodies
from flexkv_py.coordinator.jobs import INTERNAL, Job, JobResult, LoadJob, StoreJob, drops_first
from flexkv_py.coordinator.late_io import LateIo, fence_store, with_failed
from flexkv_py.coordinator.leg_handlers import Flow, Handlers
from flexkv_py.coordinator.store_copies import D2h
from flexkv_py.errors import ClosedError
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.lower_tiers import configured_tiers, open_lower_tiers
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.registry import specs
from flexkv_py.transfer.stream_order import OrderedTransfer, Transfer

logger = logging.getLogger(__name__)

__all__ = ["ExecutorOptions", "JobExecutor", "JobHandle", "build_host_side"]


@dataclass(frozen=True)
class ExecutorOptions:
    """How to build a JobExecutor beyond its config (CacheEngine passes these through).

    `tiers`: the lower tiers to run jobs on; None opens this rank's tiers from the config
    (tiers/lower_tiers.py). `max_workers`: threads of stores, spills and drops' writes;
    `load_workers`: threads of loads, apart, so a load never queues behind stores waiting on a
    slow device (a request waiting for its load holds GPU blocks and stalls the engine)."""

    tiers: Mapping[Tier, LowerTier] | None = None
    max_workers: int = 4
    load_workers: int = 2


def _then_fail(run: Callable[[], JobResult], fenced: tuple[bytes, ...]) -> JobResult:
    """`run`'s result with the `fenced` keys (left out of the job, late_io.py) failed too."""
    return with_failed(run(), fenced)


class _HereLoad:
    """A load from host memory whose host->GPU copies the caller issued (`JobExecutor.submit`
    with `here`): its completion (wait for the copies, build the JobResult) runs in the first
    thread to `take` it: a caller waiting for the job (no hop to a load thread and back after
    the last copy), else the load thread once the copies are done."""

    def __init__(
        self, future: Future[JobResult], run: Callable[[], JobResult], to_gpu: Flow
    ) -> None:
        self.future = future
        self._run = run
        self.to_gpu = to_gpu
        self._lock = threading.Lock()
        self._taken = False
        self.waiter = False  # a caller waits without a timeout: it takes the completion

    def take(self) -> None:
        with self._lock:
            if self._taken:
                return
            self._taken = True
        try:
            result = self._run()
        except BaseException as e:
            self.future.set_exception(e)
            raise
        self.future.set_result(result)

    def wait_here(self) -> None:
        """A caller's wait: the completion runs here (polling the copies), unless the load
        thread took it first."""
        self.waiter = True
        self.to_gpu.poll = True
        self.take()

    def background(self) -> None:
        """The load thread's part: after the copies, the completion, unless a caller waits."""
        try:
            self.to_gpu.wait()
        except Exception:
            pass  # the completion reports it
        if not self.waiter:
            self.take()


class JobHandle:
    """One submitted job. `done()` never blocks; `wait()` returns its JobResult."""

    def __init__(self, job: Job, future: Future[JobResult], here: _HereLoad | None = None) -> None:
        self.job = job
        self._future = future
        self._here = here

    @property
    def job_id(self) -> int:
        return self.job.job_id

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> JobResult:
        here = self._here
        if here is not None and timeout is None and not self._future.done():
            here.wait_here()
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"job {self.job_id} not done after {timeout} s") from None


class JobExecutor:
    def __init__(
        self,
        config: FlexKVConfig,
        namespace: Namespace,
        host_pool: HostSlots,
        transfer: Transfer | None = None,
        *,
        options: ExecutorOptions | None = None,
        owns: Iterable[Any] = (),
    ) -> None:
        """`owns`: objects closed by `shutdown` (e.g. a pool and engine built by from_kv_caches)."""
        options = options or ExecutorOptions()
        self.config = config
        self.namespace = namespace
        self.pool = host_pool
        self.transfer = transfer
        # A tier that cannot be opened leaves this rank without it (see tiers/ssd/opener.py):
        # `unavailable` says why, every job part naming it fails fast.
        self.unavailable: dict[Tier, str] = {}
        if options.tiers is None:
            tiers, self.unavailable = open_lower_tiers(config, namespace)
        else:
            tiers = dict(options.tiers)
        self.tiers: dict[Tier, LowerTier] = tiers
        # Bounded lower-tier waits and the host slots a timed-out batch may still touch.
        self.late_io = LateIo(
            config.ssd_io_timeout_s,
            (*configured_tiers(config), *tiers),
            {spec.tier: spec.io_timeout_s(config) for spec in specs()},
        )
        self._threads = ThreadPoolExecutor(options.max_workers, thread_name_prefix="flexkv-job")
        # Loads have threads of their own: with write-through, every job thread can be waiting
        # on an SSD write (seconds on a busy disk, up to ssd_io_timeout_s); a load queued behind
        # them would keep its request waiting, with its GPU blocks, that long.
        self._load_threads = ThreadPoolExecutor(
            options.load_workers, thread_name_prefix="flexkv-load"
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a submit call ends
        self._handles: dict[int, JobHandle] = {}
        self._finished: dict[int, JobResult] = {}
        self._reads = GpuReads(self._lock)  # store jobs that may still read GPU blocks
        self._submitting = 0  # submit calls in progress (shutdown waits for them)
        self._owns = list(owns)
        self._closed = False  # no new jobs
        self._released = False  # lower tiers and owned objects closed
        self._stats = Counters()
        self._transfer = OrderedTransfer(transfer)
        self._bodies = JobBodies(
            host_pool, self.tiers, self.late_io, self._transfer, self._reads, self._stats
        )
        # The body of each purpose but the store (whose GPU->host copy starts in `submit`).
        self._purposes: dict[str, Callable[[Any, float], JobResult]] = {
            "load": self._bodies.load,
            "spill": self._bodies.spill,
            "drop": self._bodies.deletes.drop,
            "move": self._bodies.move,
        }

    @property
    def handlers(self) -> Handlers:
        """The leg handlers, by (source medium, destination medium): register another path
        (GPU <-> SSD, GPU <-> peer) here."""
        return self._bodies.handlers

    @classmethod
    def from_kv_caches(
        cls,
        config: FlexKVConfig,
        namespace: Namespace,
        kv_caches: Mapping[str, Any],
        *,
        serving: bool = False,
        options: ExecutorOptions | None = None,
    ) -> JobExecutor:
        """Build this rank's host pool and transfer engine for vLLM's registered KV caches
        (`serving`: for the vLLM connector, see host_pool_in_background)."""
        pool, engine = build_host_side(config, namespace, kv_caches, serving=serving)
        return cls(config, namespace, pool, engine, options=options, owns=(engine, pool))

    @property
    def num_host_slots(self) -> int:
        return self.pool.num_slots

    # ------------------------------------------------------------------ submit / complete
    def submit(
        self, job: Job, fill: Callable[[], None] | None = None, *, here: bool = False
    ) -> JobHandle:
        """Start a job. `fill` (host-only stores, in-process callers): writes the pages into the
        job's slots; it runs on the job thread after the job's spills have read those slots.
        `here` (in-process callers that wait for their loads): a load whose blocks are all in
        host memory issues its host->GPU copies now, in the caller's thread (ordered after the
        caller's stream, as a store's copy is), and its completion runs in the thread that
        waits for it (see _HereLoad)."""
        shown: Job = job
        fenced: tuple[bytes, ...] = ()
        store = job if job.kind == "store" else None
        if store is not None:  # never write into a slot a timed-out I/O may touch
            assert isinstance(store, StoreJob)
            job, fenced = fence_store(
                store, self.late_io.fenced(store.host_slots), fill is not None
            )
            fill = None if fenced and fill is not None else fill
        reads_gpu = store is not None and job.gpu_block_ids is not None and bool(job.keys)
        with self._lock:
            if self._closed:
                raise ClosedError("job executor is shut down")
            self._submitting += 1
            if reads_gpu:
                self._reads.begin_locked(job.job_id)
        try:
            return self._submit(job, fill, reads_gpu, shown, fenced, here)
        except BaseException:
            self._reads.end(job.job_id)
            raise
        finally:
            with self._lock:
                self._submitting -= 1
                self._idle.notify_all()

    def _submit(
        self,
        job: Job,
        fill: Callable[[], None] | None,
        reads_gpu: bool,
        shown: Job,
        fenced: tuple[bytes, ...],
        here: bool = False,
    ) -> JobHandle:
        """Run `job`, the part of `shown` that can run; `fenced` keys of `shown` fail."""
        started = time.perf_counter()
        bodies = self._bodies
        first = drops_first(job)
        # Room for its writes, first; what it deleted by fingerprint goes into its result.
        pre_dropped = bodies.deletes.run(first) if first else {}
        here_load = None
        future: Future[JobResult]
        if (
            here
            and isinstance(job, LoadJob)
            and job.gpu_block_ids is not None
            and not job.spill.keys
            and not fenced
            and job.all_from_host
        ):
            here_load = self._here_load(job, started, pre_dropped)
            future = here_load.future
        else:
            run: Callable[[], JobResult]
            if job.kind == "store":
                assert isinstance(job, StoreJob)
                d2h, d2h_error = self._start_copy(job) if reads_gpu else (None, None)
                run = functools.partial(bodies.store, job, d2h, d2h_error, started, fill)
            else:
                run = functools.partial(self._purposes[job.kind], job, started)
            if job.kind == "drop":  # inside submit: before any job submitted after it
                future = Future()
                future.set_result(self._guard(job, started, run, pre_dropped))
            else:
                if fenced:
                    run = functools.partial(_then_fail, run, fenced)
                # `shown`: a crash fails every block of the job, fenced ones included.
                pool = self._load_threads if job.kind == "load" else self._threads
                future = pool.submit(self._guard, shown, started, run, pre_dropped)
        handle = JobHandle(shown, future, here_load)
        with self._lock:
            self._handles[job.job_id] = handle
            if reads_gpu:
                self._reads.watch_locked(job.job_id)
        future.add_done_callback(self._on_done)
        return handle

    def _here_load(
        self, job: LoadJob, started: float, pre_dropped: dict[Tier, tuple[bytes, ...]]
    ) -> _HereLoad:
        """Issue an all-host load's copies in the caller's thread (see `submit`'s `here`)."""
        bodies = self._bodies
        to_gpu = bodies.gpu_leg(job)
        to_gpu.feed_all()
        here = _HereLoad(
            Future(),
            lambda: self._guard(
                job, started, lambda: bodies.load(job, started, to_gpu), pre_dropped
            ),
            to_gpu,
        )
        self._load_threads.submit(here.background)
        return here

    def _start_copy(self, job: StoreJob) -> tuple[D2h, BaseException | None]:
        """Issue a store's GPU->host copy now, in the caller's thread (ordered after its
        stream), or mark the caller's stream for a copy the job issues after its spill."""
        assert job.gpu_block_ids is not None
        try:
            if job.spill.keys or len(set(job.host_slots)) < len(job.host_slots):
                # The slots must be written out first (a spill, or the round before in a store
                # streamed through reused slots): remember the point on the caller's stream
                # the copies have to follow, issue them from the job thread.
                return self._transfer.mark(), None
            return self._bodies.copies.start(job), None
        except Exception as e:  # bad ids, engine closed: fail the blocks, keep going
            self._reads.end(job.job_id)  # no copy: nothing reads the GPU blocks
            return None, e

    def _guard(
        self,
        job: Job,
        started: float,
        run: Callable[[], JobResult],
        pre_dropped: dict[Tier, tuple[bytes, ...]],
    ) -> JobResult:
        """`run()`'s result, or every block failed if it raised; either way with what the
        job's `drop_first` deleted by fingerprint (announced whatever became of the job)."""
        try:
            result = run()
        except Exception:
            logger.exception("job %d (%s) failed unexpectedly", job.job_id, job.kind)
            failed = dict.fromkeys(job.keys, INTERNAL)
            gpu = frozenset(job.gpu_block_ids or ()) if job.kind == "load" else frozenset()
            self._stats.add("jobs_crashed")
            result = JobResult(
                job.job_id,
                job.kind,
                failed=failed,
                failed_gpu_block_ids=gpu,
                seconds=time.perf_counter() - started,
            )
        finally:
            self._reads.end(job.job_id)
        if pre_dropped:
            result = dataclasses.replace(result, dropped=pre_dropped)
        counts = Counter(f"failed_{job.kind}_{reason}" for reason in result.failed.values())
        counts[f"jobs_{job.kind}"] += 1
        self._stats.add_many(counts)
        return result

    def _on_done(self, future: Future[JobResult]) -> None:
        result = future.result()  # _guard never raises
        with self._lock:
            if result.job_id in self._handles:
                self._finished[result.job_id] = result

    def poll(self) -> list[JobResult]:
        """Results of jobs finished since the last poll/wait (each result is returned once)."""
        with self._lock:
            out = list(self._finished.values())
            for r in out:
                del self._handles[r.job_id]
                self._reads.forget_locked(r.job_id)
            self._finished.clear()
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until the given jobs finish; returns their results not yet returned by poll.
        Unknown or already-returned ids are ignored. TimeoutError if not all are done in time;
        then no result is consumed: `poll` returns each one once its job finishes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            handles = [h for h in map(self._handles.get, job_ids) if h is not None]
        for handle in handles:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            handle.wait(remaining)
        out: list[JobResult] = []
        with self._lock:
            for handle in handles:
                if self._handles.pop(handle.job_id, None) is not None:
                    self._finished.pop(handle.job_id, None)
                    self._reads.forget_locked(handle.job_id)
                    out.append(handle.wait(0))  # done: returns at once
        return out

    def abandon(self, job_ids: Iterable[int]) -> list[int]:
        """Stop trusting the GPU->host copy of these store jobs: the caller is about to reuse
        their GPU blocks. A job whose copy may still run fails all its blocks (nothing it read is
        committed) and writes none of them to a lower tier; one whose copy already finished is
        untouched. The job still runs to its end (its host slots stay pinned until then) and its
        result comes from `poll`/`wait` as usual. Returns the ids of the jobs that will fail."""
        out = self._reads.abandon(job_ids)
        self._stats.add("jobs_abandoned", len(out))
        return out

    def poll_gpu_reads(self) -> list[int]:
        """Store jobs whose GPU->host copy ended (finished, failed, abandoned or never issued)
        since the last call: their GPU blocks may be reused, although the jobs may still run
        (lower-tier write-through). Non-blocking. Each job is named once, and no later than its
        result is available from `poll`/`wait`; a job whose result was taken before is not
        named (the result says more). Only store jobs that read GPU blocks are named."""
        return self._reads.poll()

    def wait_gpu_reads(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until none of these jobs reads GPU blocks any more (see `poll_gpu_reads`,
        which still names them). Unknown or finished ids are ignored. TimeoutError if a copy is
        still running after `timeout`; nothing is consumed either way."""
        self._reads.wait(job_ids, timeout)

    def pending(self) -> int:
        with self._lock:
            return len(self._handles)

    # ------------------------------------------------------------------ inventory / lifecycle
    def stored_keys(self, tier: Tier = Tier.SSD) -> list[bytes]:
        """Logical keys of this namespace in this rank's `tier` (its restart inventory); none
        when the rank has no such tier (off, or unavailable: nothing is adopted from it)."""
        lower = self.tiers.get(tier)
        return lower.keys() if lower is not None else []

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._stats.snapshot()
        out.update(self.late_io.stats())
        for tier in configured_tiers(self.config):
            out[f"{tier.value}_unavailable"] = int(tier in self.unavailable)
        out["pending_jobs"] = self.pending()
        for tier, lower in self.tiers.items():
            out[tier.value] = lower.stats()
        return out

    def shutdown(self, timeout: float | None = None) -> bool:
        """Finish in-flight jobs (acknowledged stores reach their tiers), then close what we own.

        Bounded by `timeout`: if a job is still running then, it may still copy into host
        slots or have tier reads land in them, so the pool, transfer engine and lower tiers are
        left open (leaked, an error is logged) rather than unmapped under it; returns False.
        Calling again later retries. True once everything is closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._released:
                return True
            self._closed = True  # no new jobs from here on
            settled = self._idle.wait_for(lambda: self._submitting == 0, timeout)
            handles = list(self._handles.values())
        running = [] if settled else [-1]  # -1: a submit call still in progress
        for h in handles:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                h.wait(remaining)
            except TimeoutError:
                running.append(h.job_id)
        # A timed-out tier batch may still read or write host slots (and needs its tier).
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.late_io.settle(remaining):
            running.append(-2)  # -2: lower-tier I/O that timed out is still in flight
        if running:
            self._threads.shutdown(wait=False)
            self._load_threads.shutdown(wait=False)
            logger.error(
                "shutdown: %d jobs still running after %s s (ids %s); leaving the host pool, "
                "transfer engine and lower tiers open rather than unmapping memory they may use",
                len(running),
                timeout,
                running[:16],
            )
            return False
        self._threads.shutdown(wait=True)
        self._load_threads.shutdown(wait=True)
        self._released = True
        # Each one, even after one failed (an SSD whose journal cannot take its clean-shutdown
        # record): the host pool and transfer engine are not leaked; the first error is raised.
        errors: list[Exception] = []
        for obj in [*self.tiers.values(), *self._owns]:
            try:
                obj.close()
            except Exception as e:
                logger.error("shutdown: closing %s failed: %s", type(obj).__name__, e)
                errors.append(e)
        if errors:
            raise errors[0]
        return True
