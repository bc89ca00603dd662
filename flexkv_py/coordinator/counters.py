"""Executor statistics that job threads, the caller's thread and `abandon` all bump: one lock,
read as a snapshot (Counter's += is a read-modify-write, not atomic across threads)."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_many(self, counts: Counter[str]) -> None:
        """Several counters in one lock hold (a job's per-reason failures)."""
        with self._lock:
            self._counts.update(counts)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
