"""The benches' wall clock for GPU work: CUDA-synchronized before and after what it times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class Clock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Seconds `fn` took, and what it returned."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out

    def median(self, fn: Callable[[], Any], reps: int) -> float:
        """Median seconds of `reps` runs of `fn`."""
        return statistics.median(self.time(fn)[0] for _ in range(reps))
