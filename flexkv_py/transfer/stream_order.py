"""Ordering GPU <-> host copies issued away from the caller's CUDA stream.

The transfer engine orders every copy after the work already queued on the *current* stream of
the thread that submits it. A store's GPU->host copy submitted in the caller's thread therefore
sees the KV the model wrote. A store that must first spill the slots it reuses issues its copy
later, from a job thread, whose current stream knows nothing of the caller's work: the caller
takes a `StreamMark` (an event recorded on its stream) at submit, and `OrderedTransfer.submit`
with `after=mark` issues the copy from a side stream (one per device) that waits for that event,
so the engine orders the copy behind it. Without CUDA there is nothing to order and the mark is
empty.

`OrderedTransfer` also serialises submits (one at a time): the side stream's wait and the
engine's copy must not interleave with another thread's.

torch is imported only when a CUDA device is in play: the coordinator imports this module on
scheduler-side and CPU-only paths.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from flexkv_py.errors import InternalStateError

Direction = Literal["d2h", "h2d"]


class TransferHandleLike(Protocol):
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> None: ...


class Transfer(Protocol):
    """What the coordinator needs from flexkv_py.transfer.TransferEngine."""

    def submit_d2h(
        self, gpu_block_ids: Sequence[int], host_slots: Sequence[int]
    ) -> TransferHandleLike: ...
    def submit_h2d(
        self, host_slots: Sequence[int], gpu_block_ids: Sequence[int]
    ) -> TransferHandleLike: ...


class StreamMark:
    """Where the caller's CUDA stream is now: a copy issued later (from any thread) through
    `OrderedTransfer.submit(..., after=mark)` starts behind it. Without CUDA there is nothing
    to order and `event` is None."""

    def __init__(self, transfer: Any) -> None:
        device = getattr(transfer, "device", None)
        self.event: Any = None
        self.device: Any = None
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            self.device = device
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))


class OrderedTransfer:
    """A transfer engine (or None: host-only) with ordered, serialised submits."""

    def __init__(self, transfer: Transfer | None) -> None:
        self.transfer = transfer
        self._lock = threading.Lock()  # one transfer submit at a time
        self._side_streams: dict[Any, Any] = {}  # CUDA device -> side stream for later copies

    def mark(self) -> StreamMark:
        """The caller's stream position, for a copy this thread cannot issue now."""
        return StreamMark(self.transfer)

    def submit(
        self,
        direction: Direction,
        gpu_ids: Sequence[int],
        slots: Sequence[int],
        after: StreamMark | None = None,
    ) -> TransferHandleLike:
        """Issue one copy; with `after` (CUDA), it starts behind that point of the caller's
        stream: the device's side stream carries the wait into the transfer engine, which
        orders its copy after the current stream."""
        transfer = self.transfer
        if transfer is None:
            raise InternalStateError(
                "job moves GPU blocks but this executor has no transfer engine"
            )

        def issue() -> TransferHandleLike:
            if direction == "d2h":
                return transfer.submit_d2h(gpu_ids, slots)
            return transfer.submit_h2d(slots, gpu_ids)

        with self._lock:
            if after is None or after.event is None:
                return issue()
            import torch

            side = self._side_streams.get(after.device)
            if side is None:
                side = self._side_streams[after.device] = torch.cuda.Stream(after.device)
            side.wait_event(after.event)
            with torch.cuda.stream(side):
                return issue()
