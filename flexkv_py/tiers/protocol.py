"""The seam every tier below host memory implements: what the worker-side executor calls.

A lower tier stores whole blocks under this rank's logical keys and moves them in batches
between host-pool memory and its medium. The executor holds one `LowerTier` per `Tier` it was
given (the SSD store, the node tier, the object tier: tiers/registry.py) and runs each
job's I/O "for every lower tier the job names", so a new tier is a new implementation of this
protocol, not a new branch in the job bodies.

Batches are asynchronous: `submit_put` / `submit_get` return at once with a handle whose
`wait(timeout)` gives one result per item, in order, and raises TimeoutError when the tier is
slow (the executor then fences the host slots, see coordinator/late_io.py). A result's `status`
is one of the store statuses that `flexkv_py.coordinator.jobs.STATUS_REASON` maps to a job
failure reason; a tier must not invent others.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from flexkv_py.index.tier_names import Tier

# (logical key, (address, nbytes)) or (logical key, buffer): one block and its host memory.
Item = tuple[bytes, Any]


class BlockResultLike(Protocol):
    """One block of a finished batch (the native store's BlockResult)."""

    @property
    def status(self) -> str: ...  # "ok", "deduped", or a failure (see jobs.STATUS_REASON)
    @property
    def ok(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...  # get: bytes placed in the buffer
    @property
    def error(self) -> str | None: ...


class BatchLike(Protocol):
    """An in-flight batch. Its buffers must stay valid until `done()` (the tier may still
    touch them after a `wait` timed out)."""

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> list[Any]: ...  # list[BlockResultLike]


class LowerTier(Protocol):
    """A block tier below host memory, as one worker (one TP/PP rank) sees it."""

    @property
    def name(self) -> Tier: ...

    def submit_put(self, items: Iterable[Item]) -> BatchLike:
        """Write each block from its buffer (write-through, spills). A tier with a true
        `stores_block_meta` attribute also takes `parents=` and `metas=` (parallel lists, None =
        absent: each block's chain parent key and opaque metadata) and keeps them with it."""
        ...

    def submit_get(self, items: Iterable[Item]) -> BatchLike:
        """Read each block into its buffer (loads)."""
        ...

    def delete(self, keys: Iterable[bytes]) -> int:
        """Forget these blocks; returns how many were stored."""
        ...

    def contains(self, key: bytes) -> bool: ...

    def drain_evicted(self) -> list[bytes]:
        """Logical keys the tier dropped on its own (capacity) since the last call."""
        ...

    def keys(self) -> list[bytes]:
        """Every logical key of this namespace and rank the tier holds (restart inventory)."""
        ...

    def stats(self) -> dict[str, int | float | str]: ...

    def close(self) -> None: ...
