"""GPU <-> host legs through the transfer engine: one copy per leg, waited for.

These are the handlers a plain leg job uses. A store's own GPU -> host copy keeps its protocol
(issued in the caller's thread, abandon, rounds: store_copies.py) and a load's host -> GPU copies
overlap its staged reads (staged_load.py); both issue through the same `OrderedTransfer`.
"""

from __future__ import annotations

import logging

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import TRANSFER_ERROR
from flexkv_py.coordinator.leg_handlers import Moved
from flexkv_py.coordinator.legs import Gpu, Host, Leg
from flexkv_py.transfer.stream_order import Direction, OrderedTransfer

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

    def move(self, leg: Leg) -> Moved:
        gpu, host = (leg.src, leg.dst) if self.direction == "d2h" else (leg.dst, leg.src)
        assert isinstance(gpu, Gpu) and isinstance(host, Host)  # registered for this pair
        try:
            self.transfer.submit(self.direction, gpu.ids, host.slots).wait()
        except Exception as e:  # bad ids, engine closed: the leg's blocks fail
            logger.warning("%s copy of %d blocks failed: %s", self.direction, len(leg.keys), e)
            return Moved(dict.fromkeys(leg.keys, TRANSFER_ERROR))
        self.stats.add(f"{self.direction}_blocks", len(leg.keys))
        return Moved(nbytes=len(leg.keys) * self.slot_nbytes)
