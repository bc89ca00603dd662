"""A load staged through a lower tier, in pieces: the sub-batches its reads are split into and
the host->GPU copy of each piece as soon as it is in host memory (job_bodies.py runs them).
"""

from __future__ import annotations

import logging
import time

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import TRANSFER_ERROR, LoadJob
from flexkv_py.coordinator.legs import Leg
from flexkv_py.coordinator.planning import store_rounds
from flexkv_py.transfer.stream_order import OrderedTransfer, TransferHandleLike

logger = logging.getLogger(__name__)

# A load staged through a lower tier reads in sub-batches of about READ_BATCH_BYTES with up to
# READS_IN_FLIGHT outstanding, and copies each sub-batch to the GPU as soon as it lands: the
# store's per-batch head (lookups, pins, iovecs) and tail (checksum verify, on its batch thread)
# overlap other sub-batches' I/O, and the host->GPU copy overlaps the reads instead of following
# them. One fewer in flight than the store's 4 batch threads leaves one for other jobs' I/O.
READ_BATCH_BYTES = 64 << 20
READS_IN_FLIGHT = 3


class LoadCopies:
    """A load's host->GPU copies: one per group of blocks that reached host memory (those
    already there, then each lower-tier sub-batch), issued at once and waited at the end."""

    def __init__(self, transfer: OrderedTransfer, stats: Counters, job: LoadJob) -> None:
        self.transfer = transfer
        self.stats = stats
        self.job = job
        self.issued: list[tuple[list[int], TransferHandleLike | Exception]] = []
        # `finish` polls the copies instead of sleeping in the CUDA event's blocking wait: set
        # by a caller that waits for its own load (executor.py, _HereLoad), so the thread that
        # completes the load runs as the last copy ends, not a wake-up later (~0.1-0.2 ms).
        self.spin = False

    def issue(self, positions: list[int]) -> None:
        gpu = self.job.gpu
        if gpu is None or not positions:
            return
        ids, slots = gpu.ids, self.job.host.slots
        try:
            handle: TransferHandleLike | Exception = self.transfer.submit(
                "h2d", [ids[i] for i in positions], [slots[i] for i in positions]
            )
        except Exception as e:  # bad ids, engine closed: these blocks fail, the rest go on
            handle = e
        self.issued.append((positions, handle))

    def settle(self) -> None:
        """Wait for every copy, quietly (`finish` reports the failed ones)."""
        for _, handle in self.issued:
            if not isinstance(handle, Exception):
                try:
                    handle.wait()
                except Exception:
                    pass

    def finish(self, failed: dict[bytes, str]) -> int:
        """Wait for every copy; the blocks of a failed one fail (TRANSFER_ERROR) in `failed`.
        Returns how many blocks reached the GPU."""
        copied = 0
        for positions, handle in self.issued:
            try:
                if isinstance(handle, Exception):
                    raise handle
                if self.spin:
                    while not handle.done():
                        time.sleep(0)  # lets other threads run (the GIL)
                handle.wait()
                copied += len(positions)
            except Exception as e:
                logger.warning("load job %d: host->GPU copy failed: %s", self.job.job_id, e)
                failed.update((self.job.keys[i], TRANSFER_ERROR) for i in positions)
        if copied:
            self.stats.add("h2d_blocks", copied)
        return copied


def sub_batches(n: int, block_nbytes: int, batch_bytes: int) -> list[tuple[int, int]]:
    """(lo, hi) of the sub-batches `n` blocks are read in: about `batch_bytes` each."""
    size = max(1, batch_bytes // max(1, block_nbytes))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def in_host(job: LoadJob) -> list[int]:
    """The positions of a load's blocks already in host memory (neither read nor missing)."""
    n = len(job.blocks)
    if job.all_from_host:
        return list(range(n))
    elsewhere = set(job.missing).union(*job.read_positions)
    return [i for i in range(n) if i not in elsewhere]


def _slots(leg: Leg) -> tuple[int, ...]:
    return leg.dst.places() or ()


def load_rounds(job: LoadJob) -> list[list[tuple[Leg, list[int]]]]:
    """A load's reads in rounds: per round, each read (the part of a leg of `job.reads` in that
    round) with the positions of its blocks in the job. One round unless the load streams
    through fewer staging slots than it reads blocks (coordinator/loads.py): then round r holds
    each staging slot's (r+1)-th use, in job order."""
    read_positions = job.read_positions
    reads = list(zip(job.reads, read_positions, strict=True))
    used = [s for leg in job.reads for s in _slots(leg)]
    if len(set(used)) == len(used):  # the common case: no slot reused, one round
        return [reads] if reads else []
    slots = job.host.slots
    staged = sorted(i for at in read_positions for i in at)
    round_of: dict[int, int] = {}
    rounds = store_rounds([slots[i] for i in staged])
    for r, part in enumerate(rounds):
        round_of.update((staged[j], r) for j in part)
    out: list[list[tuple[Leg, list[int]]]] = []
    for r in range(len(rounds)):
        parts = []
        for leg, at in reads:
            mine = [j for j, i in enumerate(at) if round_of[i] == r]
            if mine:
                parts.append((leg.take(mine), [at[j] for j in mine]))
        out.append(parts)
    return out
