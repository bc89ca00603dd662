"""Worker side: runs the manager's jobs on this rank's host pool, SSD tier and GPU KV cache.

Host <-> SSD goes through the native store's async batches straight on pool memory: each block
buffer is ``(pool.slot_address(slot), pool.slot_nbytes)`` (4096-aligned, so O_DIRECT needs no
bounce copy). GPU <-> host goes through the transfer engine.

Ordering: a store's GPU->host copy is submitted in the caller's thread inside `submit`, so it is
ordered after the model work already queued on the caller's CUDA stream; everything that follows
(waiting, SSD I/O, host->GPU copies) runs on a small thread pool. Drops run inside `submit`, so a
drop happens before any job submitted after it. Jobs never reuse a slot another in-flight job
uses: the manager guarantees that with pins.

Every job completes, and every block that did not make it is reported in its JobResult; an
unexpected exception fails all blocks of the job rather than leaving them unreported.

A caller that stops waiting for a store while its GPU->host copy may still run (vLLM reuses a
preempted request's blocks) calls `abandon`: the job's blocks fail, so nothing the late copy read
is ever committed. Its host slots stay pinned until the job really ends, so the late copy only
lands in memory nobody else uses.

A store reads GPU memory only in its GPU->host copy; its SSD write-through (and, for a store
reusing evicted slots, the spill before the copy) reads host slots. So "GPU read done" is reported
apart from job completion: `poll_gpu_reads` names each store job once its copy finished, failed
or will never be issued (abandoned, submit failed, job crashed), and `wait_gpu_reads` blocks on
that alone. The caller may reuse the job's GPU blocks from then on, while the job still runs.
A copy issued at submit is watched through its transfer handle, so the report does not wait for
a job thread (those may all be busy with SSD writes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.jobs import (
    CORRUPT,
    INTERNAL,
    IO_ERROR,
    IO_TIMEOUT,
    MISSING,
    NO_SPACE,
    NOT_FOUND,
    TRANSFER_ERROR,
    DropJob,
    Job,
    JobResult,
    LoadJob,
    SpillJob,
    StoreJob,
)
from flexkv_py.coordinator.late_io import LateIo, fence_store, with_failed
from flexkv_py.coordinator.planning import host_pool_in_background, host_slots_for
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.memory_limit import check_host_pool_fits
from flexkv_py.tiers.ssd_open import open_ssd_tier
from flexkv_py.tiers.ssd_tier import SsdTier

logger = logging.getLogger(__name__)

_STATUS_REASON = {
    "not_found": NOT_FOUND,
    "corrupt": CORRUPT,
    "io_error": IO_ERROR,
    "no_space": NO_SPACE,
    "rejected": NO_SPACE,
    "bad_buffer": INTERNAL,
}


class HostSlots(Protocol):
    """What the executor needs from the host pool (flexkv_py.tiers.host_pool.HostPool)."""

    num_slots: int
    slot_nbytes: int

    def slot_address(self, slot: int) -> int: ...
    @property
    def ready_slots(self) -> int: ...  # leading slots usable now (a background pool grows)
    def allow_registration(self) -> None: ...


class TransferHandleLike(Protocol):
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> None: ...


class Transfer(Protocol):
    """What the executor needs from flexkv_py.transfer.TransferEngine."""

    def submit_d2h(
        self, gpu_block_ids: Sequence[int], host_slots: Sequence[int]
    ) -> TransferHandleLike: ...
    def submit_h2d(
        self, host_slots: Sequence[int], gpu_block_ids: Sequence[int]
    ) -> TransferHandleLike: ...


class _StreamMark:
    """Where the caller's CUDA stream is now: a copy issued later (from any thread) through
    `JobExecutor._submit_transfer(..., after=mark)` starts behind it. Without CUDA there is
    nothing to order and `event` is None."""

    def __init__(self, transfer: Any) -> None:
        device = getattr(transfer, "device", None)
        self.event: Any = None
        self.device: Any = None
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            self.device = device
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))


class _GpuRead:
    """A store job that may still read GPU blocks: its copy once issued, and whether the caller
    abandoned it (see JobExecutor.abandon)."""

    __slots__ = ("abandoned", "copy")

    def __init__(self) -> None:
        self.abandoned = False
        self.copy: TransferHandleLike | None = None

    def copied(self) -> bool:
        """The copy was issued and has finished (or failed): no GPU read left."""
        return self.copy is not None and self.copy.done()


class _Abandoned(Exception):
    """The job was abandoned while it could still read GPU blocks."""


class JobHandle:
    """One submitted job. `done()` never blocks; `wait()` returns its JobResult."""

    def __init__(self, job: Job, future: Future[JobResult]) -> None:
        self.job = job
        self._future = future

    @property
    def job_id(self) -> int:
        return self.job.job_id

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> JobResult:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"job {self.job_id} not done after {timeout} s") from None


_AUTO: Any = object()


def build_host_side(
    config: FlexKVConfig,
    namespace: Namespace,
    kv_caches: Mapping[str, Any],
    *,
    serving: bool = False,
) -> tuple[Any, Any]:
    """This rank's (HostPool, TransferEngine) for vLLM's registered KV caches. The pool has
    `host_slots_for(config, namespace, page)` slots, the count the scheduler-side manager plans."""
    from flexkv_py.tiers.host_pool import HostPool
    from flexkv_py.transfer import TransferEngine, describe_kv_caches

    geom = describe_kv_caches(kv_caches)
    if namespace.page_bytes and namespace.page_bytes != geom.page_nbytes:
        raise ConfigError(
            f"namespace.page_bytes: {namespace.page_bytes} does not match the KV cache page "
            f"of {geom.page_nbytes} bytes ({geom.fingerprint})"
        )
    num_slots = host_slots_for(config, namespace, geom.page_nbytes)
    # Here, in the process that allocates the pool: over the container's memory limit it would
    # be OOM-killed once the pool is touched, so refuse at start instead.
    check_host_pool_fits(config.cpu_cache_gb, num_slots * geom.slot_nbytes, namespace.world_size)
    pool = HostPool(
        num_slots,
        geom.slot_nbytes,
        huge_pages=config.host_huge_pages,
        background=host_pool_in_background(config, namespace, geom.page_nbytes, serving=serving),
    )
    try:
        engine = TransferEngine(kv_caches, pool, backend=config.transfer_engine)
    except BaseException:
        pool.close()
        raise
    return pool, engine


class JobExecutor:
    def __init__(
        self,
        config: FlexKVConfig,
        namespace: Namespace,
        host_pool: HostSlots,
        transfer: Transfer | None = None,
        *,
        ssd: SsdTier | None = _AUTO,
        max_workers: int = 4,
        owns: Iterable[Any] = (),
    ) -> None:
        """`ssd`: default builds the rank's SSD tier from `config` (None when SSD is off).
        `owns`: objects closed by `shutdown` (e.g. a pool and engine built by from_kv_caches)."""
        self.config = config
        self.namespace = namespace
        self.pool = host_pool
        self.transfer = transfer
        # An SSD tier that cannot be opened leaves this rank on the host tier alone (see
        # tiers/ssd_open.py): `ssd_unavailable` says why, every SSD job fails fast.
        self.ssd_unavailable: str | None = None
        if ssd is _AUTO:
            ssd, self.ssd_unavailable = open_ssd_tier(config, namespace)
        self.ssd: SsdTier | None = ssd
        # Bounded SSD waits and the host slots a timed-out batch may still touch (late_io.py).
        self.late_io = LateIo(config.ssd_io_timeout_s)
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="flexkv-job")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a submit call ends
        self._submit_lock = threading.Lock()  # one transfer submit at a time
        self._handles: dict[int, JobHandle] = {}
        self._finished: dict[int, JobResult] = {}
        # Store jobs that may still read GPU blocks (see abandon, wait_gpu_reads).
        self._reading: dict[int, _GpuRead] = {}
        self._read_ended = threading.Condition(self._lock)  # an entry left _reading / got a copy
        # Store jobs reading GPU blocks whose end of reading poll_gpu_reads has not reported.
        self._unreported_reads: set[int] = set()
        self._submitting = 0  # submit calls in progress (shutdown waits for them)
        self._side_streams: dict[Any, Any] = {}  # CUDA device -> side stream for chained stores
        self._owns = list(owns)
        self._closed = False  # no new jobs
        self._released = False  # SSD store and owned objects closed
        self._stats: Counter[str] = Counter()

    @classmethod
    def from_kv_caches(
        cls,
        config: FlexKVConfig,
        namespace: Namespace,
        kv_caches: Mapping[str, Any],
        *,
        serving: bool = False,
        **kw: Any,
    ) -> JobExecutor:
        """Build this rank's host pool and transfer engine for vLLM's registered KV caches
        (`serving`: for the vLLM connector, see host_pool_in_background)."""
        pool, engine = build_host_side(config, namespace, kv_caches, serving=serving)
        return cls(config, namespace, pool, engine, owns=(engine, pool), **kw)

    @property
    def num_host_slots(self) -> int:
        return self.pool.num_slots

    # ------------------------------------------------------------------ submit / complete
    def submit(self, job: Job, fill: Callable[[], None] | None = None) -> JobHandle:
        """Start a job. `fill` (host-only stores, in-process callers): writes the pages into the
        job's slots; it runs on the job thread after the job's spills have read those slots."""
        shown: Job = job
        fenced: tuple[bytes, ...] = ()
        if isinstance(job, StoreJob):  # never write into a slot a timed-out I/O may touch
            job, fenced = fence_store(job, self.late_io.fenced(job.host_slots), fill is not None)
            fill = None if fenced and fill is not None else fill
        reads_gpu = isinstance(job, StoreJob) and job.gpu_block_ids is not None and bool(job.keys)
        with self._lock:
            if self._closed:
                raise RuntimeError("job executor is shut down")
            self._submitting += 1
            if reads_gpu:
                self._reading[job.job_id] = _GpuRead()
        try:
            return self._submit(job, fill, reads_gpu, shown, fenced)
        except BaseException:
            with self._lock:
                self._reading.pop(job.job_id, None)
                self._read_ended.notify_all()
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
    ) -> JobHandle:
        """Run `job`, the part of `shown` that can run; `fenced` keys of `shown` fail."""
        started = time.perf_counter()
        if isinstance(job, DropJob):
            future: Future[JobResult] = Future()
            future.set_result(self._guard(job, started, lambda: self._run_drop(job, started)))
        else:
            d2h: Any = None
            d2h_error: BaseException | None = None
            if reads_gpu:
                assert isinstance(job, StoreJob) and job.gpu_block_ids is not None
                try:
                    if job.spill_keys:
                        # The slots must be written out first: remember the point on the
                        # caller's stream the copy has to follow, issue it after the spill.
                        d2h = _StreamMark(self.transfer)
                    else:
                        d2h = self._submit_transfer("d2h", job.gpu_block_ids, job.host_slots)
                        self._issued(job.job_id, d2h)
                except Exception as e:  # bad ids, engine closed: fail the blocks, keep going
                    d2h_error = e
                    self._end_gpu_read(job.job_id)  # no copy: nothing reads the GPU blocks
            run = self._runner(job, d2h, d2h_error, started, fill)
            if fenced:
                run = lambda run=run: with_failed(run(), fenced)  # noqa: E731
            # `shown`: a crash fails every block of the job, fenced ones included.
            future = self._threads.submit(self._guard, shown, started, run)
        handle = JobHandle(shown, future)
        with self._lock:
            self._handles[job.job_id] = handle
            if reads_gpu:
                self._unreported_reads.add(job.job_id)
        future.add_done_callback(self._on_done)
        return handle

    def _runner(
        self,
        job: Job,
        d2h: Any,
        d2h_error: BaseException | None,
        started: float,
        fill: Callable[[], None] | None,
    ) -> Any:
        if isinstance(job, StoreJob):
            return lambda: self._run_store(job, d2h, d2h_error, started, fill)
        if isinstance(job, LoadJob):
            return lambda: self._run_load(job, started)
        if isinstance(job, SpillJob):
            return lambda: self._run_spill(job, started)
        raise TypeError(f"not a job: {job!r}")

    def _guard(self, job: Job, started: float, run: Any) -> JobResult:
        try:
            result: JobResult = run()
        except Exception:
            logger.exception("job %d (%s) failed unexpectedly", job.job_id, job.kind)
            failed = dict.fromkeys(job.keys, INTERNAL)
            gpu = frozenset(job.gpu_block_ids or ()) if isinstance(job, LoadJob) else frozenset()
            self._stats["jobs_crashed"] += 1
            result = JobResult(
                job.job_id,
                job.kind,
                failed=failed,
                failed_gpu_block_ids=gpu,
                seconds=time.perf_counter() - started,
            )
        finally:
            self._end_gpu_read(job.job_id)
        self._stats[f"jobs_{job.kind}"] += 1
        for reason in result.failed.values():
            self._stats[f"failed_{job.kind}_{reason}"] += 1
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
                self._unreported_reads.discard(r.job_id)
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
                    self._unreported_reads.discard(handle.job_id)
                    out.append(handle.wait(0))  # done: returns at once
        return out

    def abandon(self, job_ids: Iterable[int]) -> list[int]:
        """Stop trusting the GPU->host copy of these store jobs: the caller is about to reuse
        their GPU blocks. A job whose copy may still run fails all its blocks (nothing it read is
        committed) and writes none of them to SSD; one whose copy already finished is untouched.
        The job still runs to its end (its host slots stay pinned until then) and its result
        comes from `poll`/`wait` as usual. Returns the ids of the jobs that will fail."""
        out: list[int] = []
        with self._lock:
            for job_id in job_ids:
                read = self._reading.get(job_id)
                if read is not None and not read.copied():
                    read.abandoned = True
                    out.append(job_id)
        self._stats["jobs_abandoned"] += len(out)
        return out

    def _abandoned(self, job_id: int) -> bool:
        with self._lock:
            read = self._reading.get(job_id)
            return read is not None and read.abandoned

    def _issued(self, job_id: int, copy: TransferHandleLike) -> None:
        """The job's GPU->host copy is issued: its end can be seen without the job thread."""
        with self._lock:
            read = self._reading.get(job_id)
            if read is not None:
                read.copy = copy
                self._read_ended.notify_all()

    def _end_gpu_read(self, job_id: int) -> bool:
        """The job reads no GPU block any more (its copy finished or will never be issued);
        True if it was abandoned before that."""
        with self._lock:
            read = self._reading.pop(job_id, None)
            if read is None:
                return False
            self._read_ended.notify_all()
            return read.abandoned

    def _still_reading(self, job_id: int) -> bool:
        read = self._reading.get(job_id)
        return read is not None and not read.copied()

    def poll_gpu_reads(self) -> list[int]:
        """Store jobs whose GPU->host copy ended (finished, failed, abandoned or never issued)
        since the last call: their GPU blocks may be reused, although the jobs may still run
        (SSD write-through). Non-blocking. Each job is named once, and no later than its result
        is available from `poll`/`wait`; a job whose result was taken before is not named (the
        result says more). Only store jobs that read GPU blocks are named."""
        with self._lock:
            out = sorted(j for j in self._unreported_reads if not self._still_reading(j))
            self._unreported_reads.difference_update(out)
        return out

    def wait_gpu_reads(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until none of these jobs reads GPU blocks any more (see `poll_gpu_reads`,
        which still names them). Unknown or finished ids are ignored. TimeoutError if a copy is
        still running after `timeout`; nothing is consumed either way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                with self._lock:
                    if not self._still_reading(job_id):
                        break
                    copy = self._reading[job_id].copy
                    if copy is None:  # not issued yet (spill first): the job thread tells us
                        if remaining is not None and remaining <= 0:
                            raise TimeoutError(
                                f"job {job_id}: GPU->host copy not issued after {timeout} s"
                            )
                        self._read_ended.wait(remaining)
                        continue
                try:
                    copy.wait(remaining)
                except TimeoutError:
                    raise TimeoutError(
                        f"job {job_id}: GPU->host copy not done after {timeout} s"
                    ) from None
                except Exception:
                    pass  # the copy failed: it reads nothing any more
                break

    def pending(self) -> int:
        with self._lock:
            return len(self._handles)

    # ------------------------------------------------------------------ job bodies
    def _slot_buf(self, slot: int) -> tuple[int, int]:
        return (self.pool.slot_address(slot), self.pool.slot_nbytes)

    def _submit_transfer(
        self,
        direction: str,
        gpu_ids: Sequence[int],
        slots: Sequence[int],
        after: _StreamMark | None = None,
    ) -> TransferHandleLike:
        """Issue one copy; with `after` (CUDA), it starts behind that point of the caller's
        stream: one side stream per device carries the wait into the transfer engine, which
        orders its copy after the current stream."""
        transfer = self.transfer
        if transfer is None:
            raise RuntimeError("job moves GPU blocks but this executor has no transfer engine")

        def issue() -> TransferHandleLike:
            if direction == "d2h":
                return transfer.submit_d2h(gpu_ids, slots)
            return transfer.submit_h2d(slots, gpu_ids)

        with self._submit_lock:
            if after is None or after.event is None:
                return issue()
            import torch

            side = self._side_streams.get(after.device)
            if side is None:
                side = self._side_streams[after.device] = torch.cuda.Stream(after.device)
            side.wait_event(after.event)
            with torch.cuda.stream(side):
                return issue()

    def _ssd_batch(
        self, put: bool, keys: Sequence[bytes], slots: Sequence[int]
    ) -> dict[bytes, str]:
        """Run one SSD batch; returns key -> failure reason for blocks that did not succeed."""
        if not keys:
            return {}
        if self.ssd is None:
            return dict.fromkeys(keys, NOT_FOUND)
        items = [(k, self._slot_buf(s)) for k, s in zip(keys, slots, strict=True)]
        batch = self.ssd.submit_put(items) if put else self.ssd.submit_get(items)
        results = self.late_io.wait(batch, slots, "write" if put else "read")
        if results is None:  # a stuck device: the blocks fail, their slots stay fenced
            return dict.fromkeys(keys, IO_TIMEOUT)
        failed: dict[bytes, str] = {}
        for key, r in zip(keys, results, strict=True):
            if not r.ok:
                failed[key] = _STATUS_REASON.get(r.status, INTERNAL)
                logger.warning(
                    "SSD %s of block %s failed: %s (%s)",
                    "write" if put else "read",
                    key.hex()[-16:],
                    r.status,
                    r.error,
                )
            elif not put and r.nbytes != self.pool.slot_nbytes:
                # Same namespace implies the same page size; anything else is not our block.
                failed[key] = CORRUPT
                logger.warning(
                    "SSD block %s has %d bytes, expected %d",
                    key.hex()[-16:],
                    r.nbytes,
                    self.pool.slot_nbytes,
                )
        self._stats["ssd_write_blocks" if put else "ssd_read_blocks"] += len(keys) - len(failed)
        return failed

    def _evicted(self) -> dict[Tier, tuple[bytes, ...]]:
        evicted = tuple(self.ssd.drain_evicted()) if self.ssd is not None else ()
        return {Tier.SSD: evicted} if evicted else {}

    def _run_store(
        self,
        job: StoreJob,
        d2h: Any,
        d2h_error: BaseException | None,
        started: float,
        fill: Callable[[], None] | None,
    ) -> JobResult:
        failed: dict[bytes, str] = {}
        spill_failed = self._ssd_batch(True, job.spill_keys, job.spill_slots)
        nbytes = (len(job.spill_keys) - len(spill_failed)) * self.pool.slot_nbytes
        if spill_failed and self.late_io.fenced(job.host_slots):
            # The spill timed out and may still read these slots: copying into them now could
            # persist our KV under the victims' keys. The copy was not issued yet (spill first).
            failed = dict.fromkeys(job.keys, IO_TIMEOUT)
            fill = None
            d2h = d2h_error = None
        if fill is not None:
            fill()
        if d2h_error is not None or d2h is not None:
            try:
                if d2h_error is not None:
                    raise d2h_error
                if isinstance(d2h, _StreamMark):
                    assert job.gpu_block_ids is not None
                    if self._abandoned(job.job_id):
                        raise _Abandoned  # the GPU blocks may hold other KV now: do not copy
                    d2h = self._submit_transfer("d2h", job.gpu_block_ids, job.host_slots, after=d2h)
                    self._issued(job.job_id, d2h)
                d2h.wait()
                if self._end_gpu_read(job.job_id):
                    raise _Abandoned
                nbytes += len(job.keys) * self.pool.slot_nbytes
                self._stats["d2h_blocks"] += len(job.keys)
            except _Abandoned:
                logger.warning(
                    "store job %d: abandoned before its GPU->host copy finished; its %d blocks "
                    "fail (their GPU blocks may have been reused)",
                    job.job_id,
                    len(job.keys),
                )
                failed = dict.fromkeys(job.keys, TRANSFER_ERROR)
                self._stats["abandoned_store_blocks"] += len(job.keys)
            except Exception as e:
                logger.warning("store job %d: GPU->host copy failed: %s", job.job_id, e)
                failed = dict.fromkeys(job.keys, TRANSFER_ERROR)
            finally:
                self._end_gpu_read(job.job_id)  # the GPU blocks are free to reuse from here
        todo = [
            (k, s)
            for k, s, w in zip(job.keys, job.host_slots, job.write_tiers, strict=True)
            if Tier.SSD in w and k not in failed
        ]
        ssd_failed = self._ssd_batch(True, [k for k, _ in todo], [s for _, s in todo])
        nbytes += (len(todo) - len(ssd_failed)) * self.pool.slot_nbytes
        return JobResult(
            job.job_id,
            "store",
            failed=failed,
            write_failed={Tier.SSD: frozenset(ssd_failed)} if ssd_failed else {},
            evicted=self._evicted(),
            spill_failed=frozenset(spill_failed),
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )

    def _run_load(self, job: LoadJob, started: float) -> JobResult:
        spill_failed = self._ssd_batch(True, job.spill_keys, job.spill_slots)
        failed: dict[bytes, str] = {
            k: MISSING for k, src in zip(job.keys, job.sources, strict=True) if src is None
        }
        from_ssd = job.reads_from(Tier.SSD)
        held = self.late_io.fenced(job.host_slots[i] for i in from_ssd)
        if held:  # a late I/O may still touch these slots: do not read into them
            failed.update((job.keys[i], IO_TIMEOUT) for i in from_ssd if job.host_slots[i] in held)
            from_ssd = [i for i in from_ssd if job.host_slots[i] not in held]
        failed.update(
            self._ssd_batch(
                False, [job.keys[i] for i in from_ssd], [job.host_slots[i] for i in from_ssd]
            )
        )
        nbytes = (len(from_ssd) - sum(job.keys[i] in failed for i in from_ssd)) * (
            self.pool.slot_nbytes
        )
        failed_gpu: set[int] = set()
        if job.gpu_block_ids is not None:
            good = [i for i, k in enumerate(job.keys) if k not in failed]
            failed_gpu = {job.gpu_block_ids[i] for i, k in enumerate(job.keys) if k in failed}
            if good:
                try:
                    h2d = self._submit_transfer(
                        "h2d",
                        [job.gpu_block_ids[i] for i in good],
                        [job.host_slots[i] for i in good],
                    )
                    h2d.wait()
                    nbytes += len(good) * self.pool.slot_nbytes
                    self._stats["h2d_blocks"] += len(good)
                except Exception as e:
                    logger.warning("load job %d: host->GPU copy failed: %s", job.job_id, e)
                    for i in good:
                        failed[job.keys[i]] = TRANSFER_ERROR
                        failed_gpu.add(job.gpu_block_ids[i])
        return JobResult(
            job.job_id,
            "load",
            failed=failed,
            failed_gpu_block_ids=frozenset(failed_gpu),
            evicted=self._evicted(),
            spill_failed=frozenset(spill_failed),
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )

    def _run_spill(self, job: SpillJob, started: float) -> JobResult:
        failed = self._ssd_batch(True, job.keys, job.host_slots)
        return JobResult(
            job.job_id,
            "spill",
            failed=failed,
            evicted=self._evicted(),
            nbytes=(len(job.keys) - len(failed)) * self.pool.slot_nbytes,
            seconds=time.perf_counter() - started,
        )

    def _run_drop(self, job: DropJob, started: float) -> JobResult:
        removed = self.ssd.delete(job.keys) if self.ssd is not None else 0
        self._stats["ssd_deleted_blocks"] += removed
        return JobResult(
            job.job_id, "drop", evicted=self._evicted(), seconds=time.perf_counter() - started
        )

    # ------------------------------------------------------------------ inventory / lifecycle
    def stored_keys(self) -> list[bytes]:
        """Logical keys of this namespace in this rank's SSD tier (restart inventory)."""
        return self.ssd.logical_keys() if self.ssd is not None else []

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out.update(self.late_io.stats())
        out["ssd_unavailable"] = int(self.ssd_unavailable is not None)
        out["pending_jobs"] = self.pending()
        if self.ssd is not None:
            out["ssd"] = self.ssd.stats()
        return out

    def shutdown(self, timeout: float | None = None) -> bool:
        """Finish in-flight jobs (acknowledged stores reach SSD), then close what we own.

        Bounded by `timeout`: if a job is still running then, it may still copy into host
        slots or have SSD reads land in them, so the pool, transfer engine and SSD store are
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
        # A timed-out SSD batch may still read or write host slots (and needs the store).
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.late_io.settle(remaining):
            running.append(-2)  # -2: SSD I/O that timed out is still in flight
        if running:
            self._threads.shutdown(wait=False)
            logger.error(
                "shutdown: %d jobs still running after %s s (ids %s); leaving the host pool, "
                "transfer engine and SSD store open rather than unmapping memory they may use",
                len(running),
                timeout,
                running[:16],
            )
            return False
        self._threads.shutdown(wait=True)
        self._released = True
        if self.ssd is not None:
            self.ssd.close()
        for obj in self._owns:
            obj.close()
        return True
