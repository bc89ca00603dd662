"""A load staged through a lower tier, in pieces: the sub-batches its reads are split into, and
the rounds of a load that reuses its staging slots (job_bodies.py runs them; each piece's
host->GPU copy is fed to the load's GPU leg as soon as it lands: copy_handlers.py).
"""

from __future__ import annotations

from flexkv_py.coordinator.jobs import LoadJob
from flexkv_py.coordinator.legs import Leg
from flexkv_py.coordinator.planning import store_rounds

# A load staged through a lower tier reads in sub-batches of about READ_BATCH_BYTES with up to
# READS_IN_FLIGHT outstanding, and copies each sub-batch to the GPU as soon as it lands: the
# store's per-batch head (lookups, pins, iovecs) and tail (checksum verify, on its batch thread)
# overlap other sub-batches' I/O, and the host->GPU copy overlaps the reads instead of following
# them. One fewer in flight than the store's 4 batch threads leaves one for other jobs' I/O.
READ_BATCH_BYTES = 64 << 20
READS_IN_FLIGHT = 3


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
