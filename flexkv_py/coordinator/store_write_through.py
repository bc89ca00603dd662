"""The store job's host -> lower-tier legs: write-through of the blocks in their host slots to
each tier (`StoreJob.writes`), and the streamed store that alternates GPU -> host rounds
with those writes when the job has fewer slots than blocks.

Kept apart from job_bodies.py (which runs every job kind and owns the per-tier batch calls)
because it is the one store-only path that loops over rounds; it calls back into the bodies
for the host -> tier legs (`handlers`) and the GPU -> host copies (`copies`), through
`StoreBodies`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from flexkv_py.coordinator.jobs import IO_TIMEOUT, TRANSFER_ERROR, StoreJob
from flexkv_py.index.tier_names import Tier
from flexkv_py.transfer.stream_order import StreamMark

if TYPE_CHECKING:
    from flexkv_py.coordinator.late_io import LateIo
    from flexkv_py.coordinator.leg_handlers import Handlers
    from flexkv_py.coordinator.store_copies import StoreCopies


class SlotMemory(Protocol):
    """Host slots by address (the host pool)."""

    slot_nbytes: int

    def slot_address(self, slot: int) -> int: ...


class StoreBodies(Protocol):
    """What the store's lower-tier leg needs of the job bodies (job_bodies.JobBodies)."""

    pool: SlotMemory
    late_io: LateIo
    copies: StoreCopies
    handlers: Handlers


def write_through(
    bodies: StoreBodies,
    job: StoreJob,
    picks: Sequence[Sequence[int]] | None,
    failed: Mapping[bytes, str],
    write_failed: dict[Tier, set[bytes]],
) -> int:
    """Run the job's write legs (`writes`), one batch per tier, for their blocks that have not
    failed: all of each leg, or (`picks[k]`) the blocks of leg k at those indices in it (one
    round of a streamed store). Returns the bytes written."""
    nbytes = 0
    keys = job.keys
    for k, (leg, at) in enumerate(zip(job.writes, job.write_positions, strict=True)):
        if picks is None and not failed:
            part = leg  # the common case: the whole leg
        else:
            mine = range(len(at)) if picks is None else picks[k]
            part = leg.take([j for j in mine if keys[at[j]] not in failed])
        moved = bodies.handlers.move(part)
        nbytes += moved.nbytes
        if moved.failed:
            assert leg.tier is not None  # a write's destination is a lower tier
            write_failed.setdefault(leg.tier, set()).update(moved.failed)
    return nbytes


def _picks_by_round(job: StoreJob, rounds: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Per round, per write leg: the indices in the leg of that round's blocks (one pass over
    each leg for the whole store, not one per round)."""
    round_of = [0] * len(job.keys)
    for r, part in enumerate(rounds):
        for i in part:
            round_of[i] = r
    out: list[list[list[int]]] = [[[] for _ in job.writes] for _ in rounds]
    for k, at in enumerate(job.write_positions):
        for j, i in enumerate(at):
            out[round_of[i]][k].append(j)
    return out


def store_in_rounds(
    bodies: StoreBodies,
    job: StoreJob,
    mark: StreamMark,
    rounds: Sequence[Sequence[int]],
    failed: dict[bytes, str],
    write_failed: dict[Tier, set[bytes]],
) -> int:
    """A store streamed through fewer slots than blocks (stores.py): per round, GPU -> host
    copy, then the write to the lower tier, which frees the slots for the next round. A
    round whose copy fails (or the job abandoned) ends the job: its blocks and every later
    round's fail, the rounds before it are kept (their copies ended before the abandon).
    Returns the bytes moved."""
    nbytes = 0
    last = len(rounds) - 1
    picks = _picks_by_round(job, rounds)
    for r, part in enumerate(rounds):
        held = bodies.late_io.fenced(job.host_slots[i] for i in part)
        if held:  # a timed-out write of the round before may still read these slots
            failed.update((job.keys[i], IO_TIMEOUT) for i in part if job.host_slots[i] in held)
            part = [i for i in part if job.host_slots[i] not in held]
        if not bodies.copies.round(job, mark, part, r == last):
            for i in (i for later in rounds[r:] for i in later):
                failed.setdefault(job.keys[i], TRANSFER_ERROR)
            break
        nbytes += len(part) * bodies.pool.slot_nbytes
        nbytes += write_through(bodies, job, picks[r], failed, write_failed)
    return nbytes
