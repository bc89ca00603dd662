"""How a synchronous store or host load of the in-process engine (engine.py) is cut into jobs."""

from __future__ import annotations

# A synchronous store (or a load from host memory) is split into jobs submitted one after the
# other: the coordinator prepares part k+1 and completes part k-1 while part k's copy runs, so
# its per-block bookkeeping hides behind the transfer instead of adding to it. What cannot hide
# is the first part's preparation (before any copy) and the last part's completion (after the
# last copy): parts double from small up to PIPELINE_MAX_BLOCKS and halve again towards the
# end, so both ends are small and the middle takes few copy launches.
PIPELINE_FIRST_BLOCKS = 64
PIPELINE_MAX_BLOCKS = 1024


def _doubling(n: int) -> list[int]:
    """Sizes summing to `n`: PIPELINE_FIRST_BLOCKS doubling to PIPELINE_MAX_BLOCKS, the last
    one absorbing a runt (less than half the next size)."""
    sizes, size = [], PIPELINE_FIRST_BLOCKS
    while n > 0:
        take = n if n - size < size // 2 else size
        sizes.append(take)
        n -= take
        size = min(2 * size, PIPELINE_MAX_BLOCKS)
    return sizes


def pipeline_parts(n: int) -> list[tuple[int, int]]:
    """(start, end) of the parts a store or load of `n` blocks is split into: sizes ramp up
    over the first half and mirror down over the second (2048 blocks: 64, 128, 256, 576, 576,
    256, 128, 64)."""
    if n <= PIPELINE_FIRST_BLOCKS:
        return [(0, n)] if n else []
    sizes = _doubling(n - n // 2) + _doubling(n // 2)[::-1]
    parts, start = [], 0
    for size in sizes:
        parts.append((start, start + size))
        start += size
    return parts
