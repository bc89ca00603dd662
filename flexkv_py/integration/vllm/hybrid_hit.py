"""The external hit of a request on a hybrid model: the longest prefix every KV cache group can
restore, as vLLM's HybridKVCacheCoordinator reconciles its own groups' local hits.

- a full-attention group needs every block of the prefix beyond the local hit;
- a sliding-window group needs only the `window_blocks` blocks before the hit's end (the last
  W-1 tokens a request resuming there attends to), mirroring vLLM's SlidingWindowManager;
  a gap further back is irrelevant;
- a Mamba (state-space) group needs one block: the state after the hit's last block, keyed by
  that block's hash (vLLM's MambaManager looks for one cached state block the same way), so it
  is a window of one block.

Each group can only shorten the hit, so the loop below reaches a fixed point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

# readable(group_id, start, stop): index of the group's first unreadable block in [start, stop)
# (stop when all are readable).
ReadableFn = Callable[[int, int, int], int]


class Group(Protocol):
    @property
    def group_id(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def window_blocks(self) -> int: ...


def window_end(need: int, first: int, end: int, readable: Callable[[int, int], int]) -> int:
    """Largest e <= end with blocks [max(first, e - need), e) all readable (first if none)."""
    e = end
    while e > first:
        lo = max(first, e - need)
        if readable(lo, e) >= e:
            return e
        i = e - 1
        while i >= lo and readable(i, i + 1) > i:
            i -= 1
        # Every end in (i, e) still has block i inside its window.
        e = i
    return first


def longest_hybrid_hit(
    groups: Sequence[Group], first: int, limit: int, readable: ReadableFn, align: int = 1
) -> int:
    """End (in hash blocks) of the longest prefix past `first` (local hit) and up to `limit`
    that every group can restore; `first` when there is none. A group whose blocks are
    `scale` hash blocks each is asked about its own blocks (`readable` takes the group's block
    indices); the end is a multiple of `align` hash blocks (vLLM's scheduler block size: the
    least common multiple of the groups' block sizes)."""
    end = limit // align * align
    while end > first:
        lowered = end
        for g in groups:
            gid, s = g.group_id, getattr(g, "scale", 1)
            lo, hi = first // s, lowered // s
            if g.kind == "full":
                got = readable(gid, lo, hi)
            else:
                got = window_end(
                    g.window_blocks,
                    lo,
                    hi,
                    lambda a, b, gid=gid: readable(gid, a, b),  # type: ignore[misc]
                )
            lowered = min(lowered, got * s) // align * align
            if lowered <= first:
                return first
        if lowered == end:
            return end
        end = lowered
    return first


def hit_limit(num_tokens: int, num_hashes: int, block_size: int, state_groups: bool) -> int:
    """Blocks a hit may cover. A hit of the whole prompt is fine for attention groups: vLLM
    then recomputes its last token (scheduler `_update_waiting_for_remote_kv`), whose sliding
    window ends inside the blocks checked. A state (Mamba) group cannot serve that: the state
    one token before the end is never cached, so the hit keeps at least the last token,
    (num_tokens - 1) // block_size blocks (vLLM's OffloadingConnector caps the same way)."""
    if not state_groups:
        return num_hashes
    return min(num_hashes, (num_tokens - 1) // block_size)
