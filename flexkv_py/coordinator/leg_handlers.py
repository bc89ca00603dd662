"""The handler registry: which code moves a leg, by (source kind, destination kind).

The executor never asks what a job is to move its blocks: it looks up the handler registered for
the leg's pair of media (legs.py) and runs it. The built-in handlers are GPU <-> host through the
transfer engine (copy_handlers.py), host <-> lower tier through the tiers' batches and lower
tier -> `Gone` (deletes) (tier_handlers.py); another path (GPU <-> SSD without a host slot,
GPU <-> peer) registers its own handler and the job classes stay as they are.

A leg runs whole (`move`) or as a `Flow` (`open`): its blocks are fed as they reach the source
(a load's lower-tier reads land sub-batch by sub-batch; a store's GPU blocks are ready at once)
and each piece moves while later ones still come. A handler that moves pieces as they come
defines `open`; for any other, the pieces fed move together when the flow is waited on (such a
handler cannot copy GPU blocks behind a mark on the caller's CUDA stream: `open` refuses).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flexkv_py.coordinator.legs import Leg, Medium
from flexkv_py.transfer.stream_order import StreamMark


@dataclass
class Moved:
    """What a leg did: key -> failure reason for the blocks that did not arrive, and the bytes
    that did."""

    failed: dict[bytes, str] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, other: Moved) -> None:
        self.failed.update(other.failed)
        self.nbytes += other.nbytes


class Flow(Protocol):
    """An open leg: pieces of its blocks (positions in the leg) are fed as they reach the
    source; `finish` waits for all of them and reports what did not arrive."""

    # Set by a caller that waits for the flow itself (CacheEngine.load): `finish` polls instead
    # of sleeping in a blocking wait, so it returns as the last piece lands, not a wake-up later.
    poll: bool

    def feed(self, positions: Sequence[int]) -> None:
        """Start moving the blocks at these positions (ascending, each fed once)."""
        ...

    def feed_all(self) -> None:
        """Start moving every block of the leg (the only piece)."""
        ...

    def done(self) -> bool:
        """Every piece fed so far has moved (or failed). Never blocks."""
        ...

    def wait(self, timeout: float | None = None) -> None:
        """Until `done()`; TimeoutError after `timeout`. Reports nothing (`finish` does)."""
        ...

    def finish(self) -> Moved:
        """Wait for every piece; the blocks that did not arrive, and the bytes that did."""
        ...


class LegHandler(Protocol):
    def move(self, leg: Leg) -> Moved:
        """Move the leg's blocks; every block that did not arrive is named in the result."""
        ...


class StreamingHandler(LegHandler, Protocol):
    def open(self, leg: Leg, after: StreamMark | None = None) -> Flow:
        """The leg as a flow. `after`: where on the caller's CUDA stream a GPU source becomes
        valid (a store of KV the model is still writing); a handler reading the GPU starts
        behind it, others have nothing to order."""
        ...


class PiecesTogether:
    """The flow of a handler that moves whole legs only: the pieces fed so far move as one leg
    when the flow is waited on (or finished), by the first thread that waits; any other
    waits for that move (a store's copy is waited on by its job thread and, through
    gpu_reads.py, by vLLM's)."""

    def __init__(self, handler: LegHandler, leg: Leg) -> None:
        self._handler = handler
        self._leg = leg
        self._pending: list[int] = []
        self._pending_lock = threading.Lock()
        self._moving = threading.Lock()  # held while a thread moves the pieces taken
        self._moved = Moved()
        self.poll = False

    def feed(self, positions: Sequence[int]) -> None:
        with self._pending_lock:
            self._pending.extend(positions)

    def feed_all(self) -> None:
        self.feed(range(len(self._leg.keys)))

    def done(self) -> bool:
        return not self._pending and not self._moving.locked()

    def wait(self, timeout: float | None = None) -> None:
        if not self._moving.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"{len(self._leg.keys)} blocks still moving after {timeout} s")
        try:
            with self._pending_lock:
                positions, self._pending = self._pending, []
            if positions:
                self._moved.add(self._handler.move(self._leg.take(positions)))
        finally:
            self._moving.release()

    def finish(self) -> Moved:
        self.wait()
        return self._moved


class Arrived:
    """The flow of blocks that are where they go once at the source (a host-only load's:
    nothing to move after the read)."""

    poll = False

    def feed(self, positions: Sequence[int]) -> None:
        pass

    def feed_all(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass

    def finish(self) -> Moved:
        return Moved()


class Handlers:
    """Leg handlers by (source medium class, destination medium class)."""

    def __init__(self) -> None:
        self._by_kinds: dict[tuple[type, type], LegHandler] = {}

    def register(self, src: type[Medium], dst: type[Medium], handler: LegHandler) -> None:
        """Run legs from `src` to `dst` with `handler` (replacing the one there was)."""
        self._by_kinds[(src, dst)] = handler

    def handler_for(self, leg: Leg) -> LegHandler:
        handler = self._by_kinds.get(leg.kinds)
        if handler is None:
            src, dst = leg.kinds
            raise LookupError(f"no handler moves blocks from {src.__name__} to {dst.__name__}")
        return handler

    def move(self, leg: Leg) -> Moved:
        """Run `leg` through its handler (an empty leg moves nothing)."""
        if not leg.keys:
            return Moved()
        return self.handler_for(leg).move(leg)

    def open(self, leg: Leg, after: StreamMark | None = None) -> Flow:
        """`leg` as a flow through its handler (see Flow; `after` as in StreamingHandler.open)."""
        handler = self.handler_for(leg)
        opener = getattr(handler, "open", None)  # a StreamingHandler (no Protocol isinstance:
        if opener is not None:  # this is on the load path, once per job)
            flow: Flow = opener(leg, after)
            return flow
        if after is not None and after.event is not None:
            # Its copy would not wait for the KV the model is still writing on that stream.
            src, dst = leg.kinds
            raise LookupError(
                f"the handler from {src.__name__} to {dst.__name__} cannot start behind the "
                "caller's CUDA stream (it has no `open`)"
            )
        return PiecesTogether(handler, leg)
