"""LateIo's fences: a host slot stays fenced while any timed-out batch that may touch it is
still running, whatever order the device completes them in."""

from __future__ import annotations

import threading
from typing import Any

from flexkv_py.coordinator.late_io import LateIo
from flexkv_py.index.tier_names import Tier


class HeldBatch:
    """A lower-tier batch the test completes by hand (the device's late completion)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[Any]:
        if not self._done.wait(timeout):
            raise TimeoutError
        return []

    def complete(self) -> None:
        self._done.set()


def test_a_slot_stays_fenced_until_every_late_batch_on_it_completes() -> None:
    late = LateIo(timeout_s=1.0, tiers=[Tier.SSD])
    first, second = HeldBatch(), HeldBatch()
    # A write-through from slot 7 times out; the block stays in slot 7, and a spill of it
    # times out too. The device completes the spill first.
    assert late.wait(first, [7, 8], "write", Tier.SSD, timeout=0.0) is None
    assert late.wait(second, [7], "write", Tier.SSD, timeout=0.0) is None
    assert late.stats()["ssd_fenced_slots"] == 2
    second.complete()
    assert late.fenced([7, 8, 9]) == {7, 8}, "the first write may still read slot 7"
    first.complete()
    assert late.fenced([7, 8, 9]) == set()
    assert late.pending() == 0 and late.stats()["ssd_fenced_slots"] == 0
    assert late.settle(0.0)


def test_settle_waits_for_every_late_batch() -> None:
    late = LateIo(timeout_s=1.0, tiers=[Tier.SSD])
    first, second = HeldBatch(), HeldBatch()
    assert late.wait(first, [1], "read", Tier.SSD, timeout=0.0) is None
    assert late.wait(second, [1], "write", Tier.SSD, timeout=0.0) is None
    first.complete()
    assert not late.settle(0.01), "the second batch is still running"
    second.complete()
    assert late.settle(0.01)
