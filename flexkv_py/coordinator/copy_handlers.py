"""GPU <-> host legs through the transfer engine, whole (`move`) or as a flow (`open`): each
piece fed is one copy issued at once, and the flow waits for them all at its end.

Every GPU <-> host copy of a job goes through here: a store's GPU -> host copy (issued in the
caller's thread at submit, or from the job thread behind the caller's stream mark:
store_copies.py), a load's host -> GPU copies (those of blocks already in host memory at once,
then one per lower-tier sub-batch as it lands: job_bodies.py), and a plain leg job's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import TRANSFER_ERROR
from flexkv_py.coordinator.leg_handlers import Moved
from flexkv_py.coordinator.legs import Gpu, Host, Leg
from flexkv_py.transfer.stream_order import (
    Direction,
    OrderedTransfer,
    StreamMark,
    TransferHandleLike,
)

logger = logging.getLogger(__name__)


class HostCopy:
    """GPU -> host (`d2h`) or host -> GPU (`h2d`) copies of a leg's blocks."""

    def __init__(
        self, direction: Direction, transfer: OrderedTransfer, stats: Counters, slot_nbytes: int
    ) -> None:
        self.direction = direction
        self.transfer = transfer
        self.stats = stats
        self.slot_nbytes = slot_nbytes

    def open(self, leg: Leg, after: StreamMark | None = None) -> CopyFlow:
        return CopyFlow(self, leg, after)

    def move(self, leg: Leg) -> Moved:
        flow = self.open(leg)
        flow.feed_all()
        return flow.finish()


class CopyFlow:
    """An open GPU <-> host leg: one transfer per piece fed, issued at once (behind `after` on
    the caller's stream, if given)."""

    def __init__(self, copy: HostCopy, leg: Leg, after: StreamMark | None) -> None:
        gpu, host = (leg.src, leg.dst) if copy.direction == "d2h" else (leg.dst, leg.src)
        assert isinstance(gpu, Gpu) and isinstance(host, Host)  # registered for this pair
        self._copy = copy
        self._keys = leg.keys
        self._ids = gpu.ids
        self._slots = host.slots
        self._after = after
        # Per piece: its positions (None: the whole leg) and its transfer, or why it failed.
        self._issued: list[tuple[Sequence[int] | None, TransferHandleLike | Exception]] = []
        self.poll = False

    def feed(self, positions: Sequence[int]) -> None:
        if positions:
            ids, slots = self._ids, self._slots
            self._issue(positions, [ids[i] for i in positions], [slots[i] for i in positions])

    def feed_all(self) -> None:
        if self._keys:
            self._issue(None, self._ids, self._slots)

    def _issue(
        self, positions: Sequence[int] | None, ids: Sequence[int], slots: Sequence[int]
    ) -> None:
        try:
            handle: TransferHandleLike | Exception = self._copy.transfer.submit(
                self._copy.direction, ids, slots, after=self._after
            )
        except Exception as e:  # bad ids, engine closed: this piece fails, the rest go on
            handle = e
        self._issued.append((positions, handle))

    def done(self) -> bool:
        return all(isinstance(h, Exception) or h.done() for _, h in self._issued)

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, handle in self._issued:
            if isinstance(handle, Exception):
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(remaining)
            except TimeoutError:
                raise
            except Exception:
                pass  # failed: `finish` reports it

    def finish(self) -> Moved:
        moved = Moved()
        copied = 0
        direction = self._copy.direction
        for positions, handle in self._issued:
            try:
                if isinstance(handle, Exception):
                    raise handle
                if self.poll:
                    while not handle.done():
                        time.sleep(0)  # lets other threads run (the GIL)
                handle.wait()
                copied += len(self._keys) if positions is None else len(positions)
            except Exception as e:
                keys = self._keys
                lost = keys if positions is None else [keys[i] for i in positions]
                logger.warning("%s copy of %d blocks failed: %s", direction, len(lost), e)
                moved.failed.update(dict.fromkeys(lost, TRANSFER_ERROR))
        if copied:
            self._copy.stats.add(f"{direction}_blocks", copied)
        moved.nbytes = copied * self._copy.slot_nbytes
        return moved
