"""The job bodies: the steps of each purpose (store, load, spill, move) on this rank, in the
order of their legs; every plain leg (a spill, a write-through, a `LegJob`'s) moves through the
handler registered for its pair of media (leg_handlers.py, registered here).

Host <-> lower tier goes through each tier's async batches straight on pool memory: each block
buffer is ``(pool.slot_address(slot), pool.slot_nbytes)`` (4096-aligned, so O_DIRECT needs no
bounce copy). GPU <-> host goes through the transfer engine (copy_handlers.py; a load's and a
store's copies run as flows, fed piece by piece; transfer/stream_order.py orders a copy issued
from a job thread).

Each body runs its lower-tier I/O "for every lower tier the job names" (`StoreJob.writes`,
`LoadJob.reads`, `SpillJob.leg`, a `Drops`' legs): one batch per tier and job part, never a
per-block call. A tier the job names that this rank does not have (off, or could not be opened:
tiers/ssd/opener.py) fails its blocks at once (`not_found`), touching no device.

Per-block statuses from a tier become failure reasons through `jobs.reason_for_status`, the one
table between the two vocabularies. A store's write-through to its lower tiers (and the
streamed store's rounds) is in store_write_through.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from flexkv_py.coordinator.copy_handlers import HostCopy
from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.drop_bodies import TierDeletes
from flexkv_py.coordinator.gpu_reads import GpuReads
from flexkv_py.coordinator.jobs import (
    CORRUPT,
    INTERNAL,
    IO_TIMEOUT,
    MISSING,
    NOT_FOUND,
    TRANSFER_ERROR,
    JobResult,
    LegJob,
    LoadJob,
    SpillJob,
    StoreJob,
    reason_for_status,
)
from flexkv_py.coordinator.late_io import LateIo
from flexkv_py.coordinator.leg_handlers import Arrived, Flow, Handlers, Moved
from flexkv_py.coordinator.legs import Blocks, Gone, Gpu, Host, Leg, OnTier
from flexkv_py.coordinator.planning import store_rounds
from flexkv_py.coordinator.staged_load import (
    READ_BATCH_BYTES,
    READS_IN_FLIGHT,
    in_host,
    load_rounds,
    sub_batches,
)
from flexkv_py.coordinator.store_copies import D2h, StoreCopies
from flexkv_py.coordinator.store_write_through import SlotMemory, store_in_rounds, write_through
from flexkv_py.coordinator.tier_handlers import TierBatch, TierDelete
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import BatchLike, LowerTier
from flexkv_py.transfer.stream_order import OrderedTransfer, StreamMark

logger = logging.getLogger(__name__)


class JobBodies:
    # Sub-batches of a staged load (staged_load.py); tests make them small.
    read_batch_bytes = READ_BATCH_BYTES
    reads_in_flight = READS_IN_FLIGHT

    def __init__(
        self,
        pool: SlotMemory,
        tiers: Mapping[Tier, LowerTier],
        late_io: LateIo,
        transfer: OrderedTransfer,
        reads: GpuReads,
        stats: Counters,
    ) -> None:
        self.pool = pool
        self.tiers = tiers
        self.late_io = late_io
        self.reads = reads
        self.stats = stats
        # Every leg moves through the handler for its pair of media (leg_handlers.py).
        self.handlers = Handlers()
        self.deletes = TierDeletes(tiers, stats, self.handlers)
        self.handlers.register(OnTier, Gone, TierDelete(self.deletes))
        self.handlers.register(Host, OnTier, TierBatch(self, put=True))
        self.handlers.register(OnTier, Host, TierBatch(self, put=False))
        self.handlers.register(Gpu, Host, HostCopy("d2h", transfer, stats, pool.slot_nbytes))
        self.handlers.register(Host, Gpu, HostCopy("h2d", transfer, stats, pool.slot_nbytes))
        self.copies = StoreCopies(self.handlers, reads, stats)

    @property
    def slot_nbytes(self) -> int:
        return self.pool.slot_nbytes

    # ------------------------------------------------------------------ lower-tier I/O
    def tier_batch(
        self,
        tier: Tier,
        put: bool,
        keys: Sequence[bytes],
        slots: Sequence[int],
        extras: Blocks | None = None,
    ) -> dict[bytes, str]:
        """Run one batch on `tier`: key -> failure reason for the blocks that did not make it.
        `extras`: the blocks of a put, whose parents and metas go with them."""
        if not keys:
            return {}
        lower = self.tiers.get(tier)
        if lower is None:
            return dict.fromkeys(keys, NOT_FOUND)
        batch = self._submit(lower, put, keys, slots, extras)
        failed = self._collect(tier, put, batch, keys, slots)
        return dict.fromkeys(keys, IO_TIMEOUT) if failed is None else failed

    def _submit(
        self,
        lower: LowerTier,
        put: bool,
        keys: Sequence[bytes],
        slots: Sequence[int],
        blocks: Blocks | None = None,
    ) -> BatchLike:
        addr, nbytes = self.pool.slot_address, self.pool.slot_nbytes
        items = [(k, (addr(s), nbytes)) for k, s in zip(keys, slots, strict=True)]
        if not put:
            return lower.submit_get(items)
        # Chain parents and token ids go with the blocks to a tier that keeps them (the SSD).
        extras = blocks.extras() if blocks is not None else None
        if extras is not None and getattr(lower, "stores_block_meta", False):
            return lower.submit_put(items, parents=extras[0], metas=extras[1])  # type: ignore[call-arg]
        return lower.submit_put(items)

    def _collect(
        self,
        tier: Tier,
        put: bool,
        batch: BatchLike,
        keys: Sequence[bytes],
        slots: Sequence[int],
        timeout: float | None = None,
    ) -> dict[bytes, str] | None:
        """The failures of a submitted batch; None if it timed out (its slots are fenced)."""
        what = "write" if put else "read"
        results = self.late_io.wait(batch, slots, what, tier, timeout)
        if results is None:  # a stuck device: the blocks fail, their slots stay fenced
            return None
        nbytes = self.pool.slot_nbytes
        failed: dict[bytes, str] = {}
        for key, r in zip(keys, results, strict=True):
            if not r.ok:
                failed[key] = reason_for_status(r.status) or INTERNAL
                logger.warning(
                    "%s %s of block %s failed: %s (%s)",
                    tier.value,
                    what,
                    key.hex()[-16:],
                    r.status,
                    r.error,
                )
            elif not put and r.nbytes != nbytes:
                # Same namespace implies the same page size; anything else is not our block.
                failed[key] = CORRUPT
                logger.warning(
                    "%s block %s has %d bytes, expected %d",
                    tier.value,
                    key.hex()[-16:],
                    r.nbytes,
                    nbytes,
                )
        self.stats.add(f"{tier.value}_{what}_blocks", len(keys) - len(failed))
        return failed

    def read_in_sub_batches(
        self,
        tier: Tier,
        keys: Sequence[bytes],
        slots: Sequence[int],
        landed: Callable[[int, int, Mapping[bytes, str]], None],
        stuck_tiers: set[Tier] | None = None,
    ) -> dict[bytes, str]:
        """Read `keys` from `tier` into `slots` in sub-batches (see sub_batches), up to
        `reads_in_flight` outstanding; `landed(lo, hi, failed)` runs as each one completes, in
        order, so its blocks can move on while later ones are still read. Returns the failures.

        Late I/O (late_io.py): a sub-batch that times out fences its own slots; the device is
        then stuck, so no further sub-batch is submitted (its blocks fail as IO_TIMEOUT,
        touching no slot) and those in flight are checked without waiting. `stuck_tiers`: the
        tiers already stuck for the caller's load (a load in rounds passes one set to every
        round), nothing is submitted to them; `tier` is added once a sub-batch times out."""
        if not keys:
            return {}
        lower = self.tiers.get(tier)
        if lower is None:
            return dict.fromkeys(keys, NOT_FOUND)
        bounds = iter(sub_batches(len(keys), self.pool.slot_nbytes, self.read_batch_bytes))
        window: deque[tuple[int, int, BatchLike]] = deque()
        failed: dict[bytes, str] = {}
        stuck = stuck_tiers is not None and tier in stuck_tiers
        try:
            while True:
                while not stuck and len(window) < self.reads_in_flight:
                    bound = next(bounds, None)
                    if bound is None:
                        break
                    lo, hi = bound
                    window.append((lo, hi, self._submit(lower, False, keys[lo:hi], slots[lo:hi])))
                if not window:
                    break
                lo, hi, batch = window.popleft()
                part = self._collect(
                    tier, False, batch, keys[lo:hi], slots[lo:hi], 0.0 if stuck else None
                )
                if part is None:
                    stuck = True
                    if stuck_tiers is not None:
                        stuck_tiers.add(tier)
                    part = dict.fromkeys(keys[lo:hi], IO_TIMEOUT)
                failed.update(part)
                landed(lo, hi, part)
        finally:
            # A submit that raised: what is already in flight may still land in its slots, so it
            # is waited for (or fenced) before the job fails.
            for lo, hi, batch in window:
                self.late_io.wait(batch, slots[lo:hi], "read", tier)
        skipped = [k for lo, hi in bounds for k in keys[lo:hi]]
        if skipped:
            logger.error(
                "%s read: %d blocks not submitted after a sub-batch timed out (io_timeout)",
                tier.value,
                len(skipped),
            )
            self.stats.add(f"{tier.value}_read_skipped_blocks", len(skipped))
            failed.update(dict.fromkeys(skipped, IO_TIMEOUT))
        return failed

    # ------------------------------------------------------------------ store
    def store(
        self,
        job: StoreJob,
        d2h: D2h,
        d2h_error: BaseException | None,
        started: float,
        fill: Callable[[], None] | None,
    ) -> JobResult:
        slot_nbytes = self.pool.slot_nbytes
        failed: dict[bytes, str] = {}
        spill = self.handlers.move(job.spill)
        spill_failed, nbytes = spill.failed, spill.nbytes
        if spill_failed and self.late_io.fenced(job.host_slots):
            # The spill timed out and may still read these slots: copying into them now could
            # persist our KV under the victims' keys. The copy was not issued yet (spill first).
            failed = dict.fromkeys(job.keys, IO_TIMEOUT)
            fill = None
            d2h = d2h_error = None
        if fill is not None:
            fill()
        write_failed: dict[Tier, set[bytes]] = {}
        rounds = store_rounds(job.host_slots)
        if len(rounds) > 1 and isinstance(d2h, StreamMark):
            nbytes += store_in_rounds(self, job, d2h, rounds, failed, write_failed)
        else:
            if d2h_error is not None or d2h is not None:
                if self.copies.all_at_once(job, d2h, d2h_error):
                    nbytes += len(job.keys) * slot_nbytes
                else:
                    failed = dict.fromkeys(job.keys, TRANSFER_ERROR)
            nbytes += write_through(self, job, None, failed, write_failed)
        return JobResult(
            job.job_id,
            "store",
            failed=failed,
            write_failed={t: frozenset(k) for t, k in write_failed.items()},
            evicted=self.deletes.evicted(),
            spill_failed=frozenset(spill_failed),
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )

    # ------------------------------------------------------------------ load
    def gpu_leg(self, job: LoadJob) -> Flow:
        """A load's host -> GPU leg (every block but the missing ones, from its slot), opened:
        its blocks are fed as they reach host memory. A host-only load's blocks are where they
        go once read."""
        if job.gpu is None:
            return Arrived()
        return self.handlers.open(Leg(job.blocks, job.host, job.gpu))

    def load(self, job: LoadJob, started: float, to_gpu: Flow | None = None) -> JobResult:
        """Blocks already in host memory are copied to the GPU at once; blocks staged from a
        lower tier are read in sub-batches and each sub-batch is fed to the GPU leg as soon as
        it lands, so the host->GPU copies overlap the reads instead of following them.
        `to_gpu`: the GPU leg with the host blocks already fed (`JobExecutor.submit(...,
        here=True)`)."""
        keys = job.keys
        if to_gpu is None:
            to_gpu = self.gpu_leg(job)
            to_gpu.feed(in_host(job))
        failed: dict[bytes, str] = {keys[i]: MISSING for i in job.missing}
        moved = Moved()
        # Tiers a read of this load timed out on: stuck for its later rounds too (late_io.py).
        stuck: set[Tier] = set()
        try:
            spill_failed = self.handlers.move(job.spill).failed
            for r, part in enumerate(load_rounds(job)):
                if r:  # the round before's host->GPU copies read these slots: wait for them
                    moved.add(to_gpu.finish())
                    to_gpu = self.gpu_leg(job)
                moved.nbytes += self._stage_round(part, to_gpu, failed, stuck)
        except BaseException:
            # The job fails whole and its GPU blocks get reused: no copy may still write them.
            to_gpu.finish()
            raise
        moved.add(to_gpu.finish())
        failed.update(moved.failed)
        failed_gpu: frozenset[int] = frozenset()
        if job.gpu is not None and failed:
            ids = job.gpu.ids
            failed_gpu = frozenset(ids[i] for i, k in enumerate(keys) if k in failed)
        return JobResult(
            job.job_id,
            "load",
            failed=failed,
            failed_gpu_block_ids=failed_gpu,
            evicted=self.deletes.evicted(),
            spill_failed=frozenset(spill_failed),
            nbytes=moved.nbytes,
            seconds=time.perf_counter() - started,
        )

    def _stage_round(
        self,
        part: Sequence[tuple[Leg, list[int]]],
        to_gpu: Flow,
        failed: dict[bytes, str],
        stuck: set[Tier],
    ) -> int:
        """Read one round of a load's lower-tier blocks into their slots, read by read (each a
        leg and its blocks' positions in the job), each sub-batch fed to the GPU leg as it
        lands; returns the bytes read. `stuck`: the load's tiers a read timed out on (in this
        round or one before): nothing more is submitted to them."""
        nbytes = 0
        for leg, at in part:
            keys, slots = leg.keys, leg.dst.places() or ()
            held = self.late_io.fenced(slots)
            if held:  # a late I/O may still touch these slots: do not read into them
                failed.update(
                    (k, IO_TIMEOUT) for k, s in zip(keys, slots, strict=True) if s in held
                )
                keep = [j for j, s in enumerate(slots) if s not in held]
                keys, slots, at = (
                    tuple(keys[j] for j in keep),
                    tuple(slots[j] for j in keep),
                    [at[j] for j in keep],
                )

            def landed(
                lo: int,
                hi: int,
                part_failed: Mapping[bytes, str],
                keys: tuple[bytes, ...] = keys,
                at: list[int] = at,
            ) -> None:
                to_gpu.feed([at[j] for j in range(lo, hi) if keys[j] not in part_failed])

            assert leg.tier is not None  # a read's source is a lower tier (LoadJob checks)
            tier_failed = self.read_in_sub_batches(leg.tier, keys, slots, landed, stuck)
            failed.update(tier_failed)
            nbytes += (len(keys) - len(tier_failed)) * self.pool.slot_nbytes
        return nbytes

    # ------------------------------------------------------------------ spill
    def spill(self, job: SpillJob, started: float) -> JobResult:
        lower = self.tiers.get(job.tier)
        remember = getattr(lower, "remember_links", None)  # the object tier's manifests
        if job.keys and job.chain_links and remember is not None:
            remember(job.chain_links)
        moved = self.handlers.move(job.leg)
        return JobResult(
            job.job_id,
            "spill",
            failed=moved.failed,
            evicted=self.deletes.evicted(),
            nbytes=moved.nbytes,
            seconds=time.perf_counter() - started,
        )

    # ------------------------------------------------------------------ legs
    def move(self, job: LegJob, started: float) -> JobResult:
        """A job of legs only: each through its handler, in order; a block that failed in a leg
        does not travel in the later ones."""
        failed: dict[bytes, str] = {}
        nbytes = 0
        for leg in job.legs:
            if failed:
                leg = leg.take([i for i, k in enumerate(leg.keys) if k not in failed])
            moved: Moved = self.handlers.move(leg)
            failed.update(moved.failed)
            nbytes += moved.nbytes
        return JobResult(
            job.job_id,
            "move",
            failed=failed,
            evicted=self.deletes.evicted(),
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )
