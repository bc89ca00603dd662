"""Several native batches behind one `BatchLike` handle: a put of several prompts' blocks runs
one native batch per chain; results come back in the caller's item order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from flexkv_py import _native


class Batches:
    def __init__(self, n: int, parts: Sequence[tuple[list[int], _native.BatchHandle]]) -> None:
        self.n = n
        self.parts = list(parts)

    def done(self) -> bool:
        return all(h.done() for _, h in self.parts)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """One result per item, in order; TimeoutError when a part is not done in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Any] = [None] * self.n
        for idx, handle in self.parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            for i, r in zip(idx, handle.wait(left), strict=True):
                out[i] = r
        return out
