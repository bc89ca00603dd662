"""The store job's host -> lower-tier legs: write-through of the blocks in their host slots to
each tier (`StoreJob.writes`), and the streamed store that alternates GPU -> host rounds
with those writes when the job has fewer slots than blocks.

Kept apart from job_bodies.py (which runs every job kind and owns the per-tier batch calls)
because it is the one store-only path that loops over rounds; it calls back into the bodies
for the host -> tier legs (`handlers`) and the GPU -> host copies (`copies`), through
`StoreBodies`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
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
    positions: Collection[int] | None,
    failed: Mapping[bytes, str],
    write_failed: dict[Tier, set[bytes]],
) -> int:
    """Run the job's write legs (`writes`) for its blocks at `positions` (None: all) that have
    not failed, one batch per tier; returns the bytes written."""
    nbytes = 0
    keys = job.keys
    for leg, at in zip(job.writes, job.write_positions, strict=True):  # none: write-back
        if positions is None and not failed:
            part = leg  # the common case: the whole leg
        else:
            part = leg.take(
                [
                    j
                    for j, i in enumerate(at)
                    if (positions is None or i in positions) and keys[i] not in failed
                ]
            )
        moved = bodies.handlers.move(part)
        nbytes += moved.nbytes
        if moved.failed:
            assert leg.tier is not None  # a write's destination is a lower tier
            write_failed.setdefault(leg.tier, set()).update(moved.failed)
    return nbytes


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
        nbytes += write_through(bodies, job, set(part), failed, write_failed)
    return nbytes
