"""Jobs (manager -> executor) and their results (executor -> manager): plain picklable data.

The manager decides everything (which slot, which blocks go to SSD); a job only says what to move.
With TP > 1 the same job goes to every rank's executor and the per-rank results are merged with
`JobResult.merge` before the manager sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

JobKind = Literal["store", "load", "spill", "drop"]

# Per-block failure reasons in JobResult.failed.
NOT_FOUND = "not_found"  # SSD: key unknown (evicted, deleted, never written on this rank)
CORRUPT = "corrupt"  # SSD: checksum/header mismatch, data discarded
IO_ERROR = "io_error"  # SSD device error (EIO, ENOSPC, short I/O)
IO_TIMEOUT = "io_timeout"  # SSD I/O not done within ssd_io_timeout_s (or its slot still is)
NO_SPACE = "no_space"  # SSD put refused: store full of pinned data / block too large
TRANSFER_ERROR = "transfer_error"  # GPU<->host copy failed
NO_SLOT = "no_slot"  # manager: no host slot free to stage the block
MISSING = "missing"  # manager: block no longer in any tier when the load was prepared
INTERNAL = "internal_error"  # executor bug or unexpected exception; block not trusted


@dataclass(frozen=True)
class StoreJob:
    """GPU blocks -> host slots; then, where `ssd_write[i]`, host slot -> SSD (write-through).
    With `spill_keys`, those blocks are first written from their slots to SSD (their slots are
    the ones this job fills), and the GPU->host copy waits for that.

    `gpu_block_ids` None: the caller already filled the slots (host-only path)."""

    job_id: int
    keys: tuple[bytes, ...]
    gpu_block_ids: tuple[int, ...] | None
    host_slots: tuple[int, ...]
    ssd_write: tuple[bool, ...]
    kind: JobKind = "store"
    # Evicted blocks whose slots this job reuses: written host -> SSD before anything else.
    spill_keys: tuple[bytes, ...] = ()
    spill_slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadJob:
    """SSD -> host slot for blocks whose source is "ssd"; then host slots -> GPU blocks.

    `source_tiers[i]`: "cpu" (already in host), "ssd" (read into `host_slots[i]` first) or "none"
    (not loadable: reported failed, `host_slots[i]` is -1). `gpu_block_ids` None: host only."""

    job_id: int
    keys: tuple[bytes, ...]
    gpu_block_ids: tuple[int, ...] | None
    host_slots: tuple[int, ...]
    source_tiers: tuple[str, ...]
    kind: JobKind = "load"
    spill_keys: tuple[bytes, ...] = ()  # as in StoreJob
    spill_slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class SpillJob:
    """Host slots -> SSD for blocks leaving the host tier (write-back)."""

    job_id: int
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]
    kind: JobKind = "spill"
    gpu_block_ids: None = None


@dataclass(frozen=True)
class DropJob:
    """Delete blocks from the SSD tier (reset, copies written after a reset, orphans)."""

    job_id: int
    keys: tuple[bytes, ...]
    kind: JobKind = "drop"
    gpu_block_ids: None = None
    host_slots: tuple[int, ...] = ()


Job = StoreJob | LoadJob | SpillJob | DropJob


@dataclass(frozen=True)
class JobResult:
    """Outcome of one job on one rank (or merged over ranks).

    failed: key -> reason for blocks that did not arrive where the job put them (load: not in
        GPU; store: not in host; spill: not on SSD). Never a partial block.
    failed_gpu_block_ids: GPU blocks whose content is not valid after a load.
    ssd_failed: store write-through copies that were not made (the host copy is fine).
    ssd_evicted: logical keys the SSD store evicted for capacity while the job ran.
    spill_failed: a job's `spill_keys` that did not reach SSD (for SpillJob: `failed`).
    """

    job_id: int
    kind: JobKind
    failed: dict[bytes, str] = field(default_factory=dict)
    failed_gpu_block_ids: frozenset[int] = frozenset()
    ssd_failed: frozenset[bytes] = frozenset()
    ssd_evicted: tuple[bytes, ...] = ()
    spill_failed: frozenset[bytes] = frozenset()
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @staticmethod
    def merge(results: Sequence[JobResult]) -> JobResult:
        """Combine the results of one job from every rank: a block failed anywhere failed."""
        if not results:
            raise ValueError("JobResult.merge needs at least one result")
        first = results[0]
        if any(r.job_id != first.job_id for r in results):
            raise ValueError("JobResult.merge: results of different jobs")
        failed: dict[bytes, str] = {}
        evicted: dict[bytes, None] = {}
        for r in results:
            for k, reason in r.failed.items():
                failed.setdefault(k, reason)
            evicted.update(dict.fromkeys(r.ssd_evicted))
        return JobResult(
            job_id=first.job_id,
            kind=first.kind,
            failed=failed,
            failed_gpu_block_ids=frozenset().union(*(r.failed_gpu_block_ids for r in results)),
            ssd_failed=frozenset().union(*(r.ssd_failed for r in results)),
            ssd_evicted=tuple(evicted),
            spill_failed=frozenset().union(*(r.spill_failed for r in results)),
            nbytes=sum(r.nbytes for r in results),
            seconds=max(r.seconds for r in results),
        )
