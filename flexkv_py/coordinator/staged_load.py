"""A load staged through a lower tier, in pieces: the sub-batches its reads are split into and
the host->GPU copy of each piece as soon as it is in host memory (job_bodies.py runs them).
"""

from __future__ import annotations

import logging
import time

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import TRANSFER_ERROR, LoadJob
from flexkv_py.coordinator.planning import store_rounds
from flexkv_py.index.tier_names import Tier
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
        ids = self.job.gpu_block_ids
        if ids is None or not positions:
            return
        slots = self.job.host_slots
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


def load_rounds(job: LoadJob) -> list[list[int]]:
    """The positions of a load's lower-tier blocks in rounds (one unless the load streams
    through fewer staging slots than it has such blocks, coordinator/loads.py)."""
    if job.sources.count(Tier.HOST) == len(job.sources):  # all from host (C-level): none
        return []
    staged = [i for i, src in enumerate(job.sources) if src is not None and src is not Tier.HOST]
    rounds = store_rounds([job.host_slots[i] for i in staged])
    return [[staged[j] for j in r] for r in rounds]
