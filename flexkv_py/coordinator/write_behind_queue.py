"""Which host blocks still owe the SSD a copy, and how fast the write-behind may pay: a FIFO of
keys (store order, so a chain's head is written before its tail) and a token bucket in blocks.

Not locked: the manager calls it under its lock. The clock is injectable so tests can step it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

# The bucket holds at most this many seconds of rate: an idle spell buys a bounded burst.
BURST_S = 0.25


class WriteBehindQueue:
    def __init__(
        self, lag_s: float, blocks_per_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lag_s = lag_s
        self.rate = blocks_per_s
        self.capacity = max(1.0, blocks_per_s * BURST_S)
        self.clock = clock
        self._tokens = self.capacity
        self._last = clock()
        self._queue: OrderedDict[bytes, float] = OrderedDict()  # key -> when it was queued

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, key: object) -> bool:
        return key in self._queue

    def add(self, key: bytes) -> None:
        self._queue.setdefault(key, self.clock())

    def discard(self, key: bytes) -> None:
        self._queue.pop(key, None)

    def clear(self) -> None:
        self._queue.clear()

    def overdue(self) -> bool:
        """The oldest queued block has waited the full lag: write even while the tier is busy."""
        if not self._queue:
            return False
        oldest = next(iter(self._queue.values()))
        return self.clock() - oldest >= self.lag_s

    def budget(self) -> int:
        """Whole blocks the rate allows now (refills the bucket)."""
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
        self._last = now
        return int(self._tokens)

    def take(self, n: int) -> list[bytes]:
        """Pop up to `n` of the oldest keys; the caller spends `spend` for those it writes."""
        out: list[bytes] = []
        while self._queue and len(out) < n:
            key, _ = self._queue.popitem(last=False)
            out.append(key)
        return out

    def spend(self, n: int) -> None:
        self._tokens -= n
