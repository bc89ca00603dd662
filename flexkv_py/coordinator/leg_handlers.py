"""The handler registry: which code moves a leg, by (source kind, destination kind).

The executor never asks what a job is to move its blocks: it looks up the handler registered for
the leg's pair of media (legs.py) and runs it. The built-in handlers are GPU <-> host through the
transfer engine (copy_handlers.py) and host <-> lower tier through the tiers' batches
(tier_handlers.py); another path (GPU <-> SSD without a host slot, GPU <-> peer) registers its
own handler and the job classes stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from flexkv_py.coordinator.legs import Leg, Medium


@dataclass
class Moved:
    """What a leg did: key -> failure reason for the blocks that did not arrive, and the bytes
    that did."""

    failed: dict[bytes, str] = field(default_factory=dict)
    nbytes: int = 0


class LegHandler(Protocol):
    def move(self, leg: Leg) -> Moved:
        """Move the leg's blocks; every block that did not arrive is named in the result."""
        ...


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
