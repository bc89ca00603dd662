"""Which GPU blocks of which KV cache group a load or a store moves (hybrid models), and the
fence that keeps a store's sliding-window blocks from being rewritten while it reads them.

Block tables come from vLLM per group (`KVCacheBlocks.get_block_ids()[g]`); a position a group
does not keep is the null block (id 0): sliding-window positions out of the window, freed by
vLLM while the request runs and before `request_finished_all_groups`. Null blocks are never
moved. One job carries every group's blocks (keys differ per group; one transfer engine moves
them all, see transfer/group_layouts.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexkv_py.integration.vllm.engine_info import GroupInfo

NULL_BLOCK = 0  # vLLM's BlockPool keeps block 0 as the null block

# (group index, block index in the request, GPU block id)
Target = tuple[int, int, int]


def load_targets(
    groups: Sequence[GroupInfo], block_ids: Sequence[Sequence[int]], first: int, end: int
) -> list[Target]:
    """Blocks [first, end) a hit ending at `end` must write: all of a full-attention group's,
    the window's (the last `window_blocks`) of a sliding-window group's, the state block at
    end - 1 of a Mamba group's. `first` and `end` count hash blocks; a target names the
    group's own block index (a group of `scale` hash blocks per block)."""
    out: list[Target] = []
    for g in groups:
        ids = block_ids[g.group_id]
        gfirst, end_g = first // g.scale, end // g.scale
        lo = gfirst if g.kind == "full" else max(gfirst, end_g - g.window_blocks)
        out.extend((g.group_id, i, ids[i]) for i in range(lo, min(end_g, len(ids))) if ids[i])
    return out


def store_targets(
    groups: Sequence[GroupInfo],
    block_ids: Sequence[Sequence[int]],
    start: int,
    stop: int,
    *,
    interval: int = 1,
    final: bool = False,
) -> list[Target]:
    """Blocks [start, stop) each group still holds (non-null). Mamba groups store only the
    boundary states vLLM hands off (`BoundaryStates`): their blocks' positions say nothing.
    `interval` > 1: a sliding-window group keeps only what a later hit can use, the window
    before every `interval`-th boundary, and (`final`: the request's last plan) the window
    before `stop`, even where an earlier plan skipped it (vLLM's reachable_block_mask).
    `start`/`stop` count hash blocks: a group of `scale` hash blocks per block stores its blocks
    that end inside [start, stop) (one that ended before `start` was planned already)."""
    out: list[Target] = []
    for g in groups:
        if g.kind == "mamba":
            continue
        ids = block_ids[g.group_id]
        start_g = start // g.scale
        end = min(stop // g.scale, len(ids))
        if g.kind != "sliding" or interval <= 1:
            out.extend((g.group_id, i, ids[i]) for i in range(start_g, end) if ids[i])
            continue
        need = g.window_blocks

        def before_boundary(i: int, need: int = need) -> bool:
            return (i // interval + 1) * interval - i <= need

        keep = {i for i in range(start_g, end) if before_boundary(i)}
        if final:
            # The tail's window; blocks before `start` an earlier plan kept are planned already.
            tail = range(max(0, end - need), end)
            keep.update(i for i in tail if i >= start_g or not before_boundary(i))
        out.extend((g.group_id, i, ids[i]) for i in sorted(keep) if ids[i])
    return out


class BoundaryStates:
    """Mamba "align" boundary states vLLM hands off (`kv_connector_block_state.
    boundary_state_offloads`: per request `(group, block id, boundary tokens)`), kept until the
    step that computes the boundary has run. They name the exact block: a Mamba group's table
    holds only the one or two state blocks vLLM keeps, so it cannot be read positionally."""

    def __init__(self, groups: Sequence[GroupInfo], block_size: int) -> None:
        self._state_groups = {g.group_id for g in groups if g.kind == "mamba"}
        self._bs = block_size
        self._pending: dict[str, list[tuple[int, int, int]]] = {}

    def offer(self, so: Any) -> None:
        """Take the step's hand-offs (vLLM drains them every step: only this one sees them)."""
        block_state = getattr(so, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        for req_id, entries in offloads.items():
            for g, block_id, boundary in entries:
                # A sub-block boundary (a prompt's partial tail) has no block hash: not cached.
                aligned = boundary > 0 and boundary % self._bs == 0
                if g in self._state_groups and block_id and aligned:
                    self._pending.setdefault(req_id, []).append((g, block_id, boundary))

    def take(self, req_id: str, tokens_with_kv: int, num_hashes: int) -> list[Target]:
        """Hand-offs whose boundary the request's KV reaches once this step ran, as targets
        (group, index of the block ending at the boundary, state block id)."""
        pending = self._pending.get(req_id)
        if not pending:
            return []
        bs = self._bs
        ready = [e for e in pending if e[2] <= tokens_with_kv and e[2] // bs <= num_hashes]
        if not ready:
            return []
        rest = [e for e in pending if e not in ready]
        if rest:
            self._pending[req_id] = rest
        else:
            del self._pending[req_id]
        return [(g, boundary // bs - 1, block_id) for g, block_id, boundary in ready]

    def forget(self, req_id: str) -> None:
        """The request's blocks are gone (finished, preempted): its states with them."""
        self._pending.pop(req_id, None)


def allocated_block_ids(so: Any) -> set[int]:
    """GPU blocks the step's scheduler output hands to requests (new and resumed requests'
    tables, running requests' new blocks): vLLM's forward writes them this step."""
    out: set[int] = set()
    for req in so.scheduled_new_reqs or ():
        for ids in req.block_ids or ():
            out.update(ids)
    for per_group in getattr(so.scheduled_cached_reqs, "new_block_ids", None) or ():
        for ids in per_group or ():
            out.update(ids)
    for copy in getattr(so, "kv_cache_block_copies", None) or ():
        dst = getattr(copy, "dst_block_id", None)
        if dst is not None:
            out.add(int(dst))
    out.discard(NULL_BLOCK)
    return out


class ReuseFence:
    """Store jobs still reading blocks that vLLM may free under a running request (sliding
    window). A job is named in the step metadata when one of its blocks is handed out again,
    and the workers wait for its GPU->host copy before that step's forward."""

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[int, ...]] = {}
        self._readers: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job_id: int, block_ids: Iterable[int]) -> None:
        ids = tuple(block_ids)
        if not ids:
            return
        self._jobs[job_id] = ids
        for b in ids:
            self._readers.setdefault(b, set()).add(job_id)

    def done(self, job_id: int) -> None:
        for b in self._jobs.pop(job_id, ()):
            readers = self._readers.get(b)
            if readers is not None:
                readers.discard(job_id)
                if not readers:
                    del self._readers[b]

    def reading(self, block_ids: Iterable[int]) -> set[int]:
        if not self._readers:
            return set()
        out: set[int] = set()
        for b in block_ids:
            out |= self._readers.get(b, set())
        return out
