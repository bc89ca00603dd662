"""The host tier's slot allocator: which of the pool's slots are free to hand out.

Not locked: the `TierIndex` that owns it calls it under its own lock, so "who holds slot N" and
"is slot N free" change together.
"""

from __future__ import annotations

from collections.abc import Iterable


class HostSlots:
    def __init__(self, num_slots: int, usable: int | None = None) -> None:
        """`usable`: how many leading slots may be handed out now (default all); a pool prepared
        in the background grows it with `grow`."""
        if num_slots < 0:
            raise ValueError("num_host_slots must be >= 0")
        usable = num_slots if usable is None else usable
        if not 0 <= usable <= num_slots:
            raise ValueError(f"usable_host_slots must be in 0..{num_slots}, got {usable}")
        self.num_slots = num_slots
        # LIFO free list: recently freed slots are reused first (warm in caches/TLB).
        self.free: list[int] = list(range(usable - 1, -1, -1))
        self.usable = usable

    def grow(self, usable: int) -> int:
        """Slots below `usable` became usable: free them. Never shrinks; returns how many."""
        usable = min(usable, self.num_slots)
        if usable <= self.usable:
            return 0
        added = usable - self.usable
        # Below the existing free slots: LIFO hands out warm (already used) slots first.
        self.free[:0] = range(usable - 1, self.usable - 1, -1)
        self.usable = usable
        return added

    def take(self, n: int) -> list[int]:
        free = self.free
        return [free.pop() for _ in range(min(n, len(free)))]

    def give_back(self, slots: Iterable[int]) -> None:
        self.free.extend(slots)

    def give(self, slot: int) -> None:
        self.free.append(slot)
