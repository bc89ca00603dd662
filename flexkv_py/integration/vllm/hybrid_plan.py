"""The scheduler side's lookups, loads and stores for a hybrid model (several KV cache groups).

Keys differ per group (each group has its own namespace); a hit is what every group can restore
(hybrid_hit.py); one job moves every group's blocks (group_plans.py); Mamba groups store the
boundary states vLLM hands off (`BoundaryStates`); stores reading sliding-window or state blocks
are registered with the `ReuseFence`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.index.namespace import PREFIX_LEN
from flexkv_py.integration.vllm.group_plans import (
    BoundaryStates,
    ReuseFence,
    Target,
    load_targets,
    store_targets,
)
from flexkv_py.integration.vllm.hybrid_hit import hit_limit, longest_hybrid_hit
from flexkv_py.integration.vllm.request_keys import HashPrefixFn, RequestKeys

if TYPE_CHECKING:
    from flexkv_py.integration.vllm.engine_info import GroupInfo
    from flexkv_py.integration.vllm.stats import FlexKVConnectorStats


logger = logging.getLogger(__name__)


class GroupHashes:
    """A request's block hashes at a group's block size (`scale` hash blocks per block): block
    i's is the hash ending at its last token (vLLM's BlockHashListWithBlockSize), so its key
    covers the whole prefix. Kept per request so the key memo (RequestKeys) stays valid."""

    __slots__ = ("request", "scale")

    def __init__(self, request: Any, scale: int) -> None:
        self.request, self.scale = request, scale

    @property
    def request_id(self) -> str:
        return str(self.request.request_id)

    @property
    def block_hashes(self) -> Sequence[bytes]:
        s = self.scale
        return self.request.block_hashes[s - 1 :: s]


class HybridPlan:
    def __init__(
        self,
        groups: Sequence[GroupInfo],
        block_size: int,
        sliding_interval: int = 1,
        align: int = 1,
    ) -> None:
        self.groups = tuple(groups)
        self._sliding_interval = sliding_interval  # sliding_store_interval_blocks
        self._bs = block_size  # the hash block size: hits, loads and stores count these
        self._align = align  # a hit ends on a multiple of this many hash blocks
        self._keys = [RequestKeys(g.namespace) for g in self.groups]
        self._views: dict[str, tuple[Any, list[Any]]] = {}  # req_id -> (request, per group)
        self._group_of = {g.namespace.prefix: g.group_id for g in self.groups}
        self.fence = ReuseFence()
        self.states = BoundaryStates(self.groups, block_size)
        self._state_groups = any(g.kind == "mamba" for g in self.groups)

    def _group_requests(self, request: Any) -> list[Any]:
        """The request as each group sees it: itself, or its hashes at the group's size."""
        got = self._views.get(request.request_id)
        if got is None or got[0] is not request:
            views = [
                request if g.scale == 1 else GroupHashes(request, g.scale) for g in self.groups
            ]
            got = self._views[request.request_id] = (request, views)
        return got[1]

    def forget(self, req_id: str) -> None:
        self._views.pop(req_id, None)
        for rk in self._keys:
            rk.forget(req_id)
        self.states.forget(req_id)

    def __len__(self) -> int:
        return sum(len(rk) for rk in self._keys)

    def limit(self, request: Any) -> int:
        """Hash blocks a hit of the request may cover (hybrid_hit.hit_limit)."""
        return hit_limit(
            request.num_tokens, len(request.block_hashes), self._bs, self._state_groups
        )

    @property
    def align(self) -> int:
        return self._align

    def group_hashes(self, request: Any, variant: bytes) -> list[tuple[bytes, Sequence[bytes]]]:
        """(index head, block hashes at the group's block size) per group: what a
        `HashPrefixFn` is asked with."""
        views = self._group_requests(request)
        return [
            (rk.head(variant), request.block_hashes if v is request else v.block_hashes)
            for rk, v in zip(self._keys, views, strict=True)
        ]

    def group_keys(self, request: Any, variant: bytes) -> list[list[bytes]]:
        """Every group's keys of the request's blocks (the memo's lists: do not change them)."""
        views = self._group_requests(request)
        return [rk.keys(v, variant) for rk, v in zip(self._keys, views, strict=True)]

    def hit(self, request: Any, first: int, variant: bytes, readable: HashPrefixFn) -> int:
        """Blocks past `first` every group can restore."""
        per_group = self.group_hashes(request, variant)

        def group_readable(gid: int, start: int, stop: int) -> int:
            head, hashes = per_group[gid]
            return readable(head, hashes, start, stop)

        limit = self.limit(request)
        end = longest_hybrid_hit(self.groups, first, limit, group_readable, self._align)
        return max(0, end - first)

    def prefix_keys(self, request: Any, variant: bytes, start: int, stop: int) -> list[bytes]:
        """Keys of hash blocks [start, stop) in every group (a group's blocks inside them)."""
        views = self._group_requests(request)
        out: list[bytes] = []
        for g, rk, v in zip(self.groups, self._keys, views, strict=True):
            lo, hi = start // g.scale, stop // g.scale
            out.extend(rk.keys(v, variant, hi)[lo:hi])
        return out

    def load(
        self,
        request: Any,
        variant: bytes,
        tables: Sequence[Sequence[int]],
        first: int,
        stop: int,
        stats: FlexKVConnectorStats,
    ) -> tuple[list[bytes], list[int], int]:
        """(keys, GPU block ids, blocks of the first group) a hit [first, stop) loads."""
        targets: list[Target] = load_targets(self.groups, tables, first, stop)
        loaded_groups = {g for g, _, _ in targets}
        if any(g.restores_state and g.group_id not in loaded_groups for g in self.groups):
            # vLLM gave a state group no block at the hit's end: nothing would write the state
            # it resumes from, so load nothing (never partial state; vLLM recomputes).
            logger.warning("%s: no state block at the hit's end; recomputing", request.request_id)
            return [], [], stop - first
        # A full-attention group's blocks first: their tiers are the hit's, block by block.
        targets.sort(key=lambda t: (self.groups[t[0]].kind != "full", self.groups[t[0]].scale))
        views = self._group_requests(request)
        memos = [
            rk.keys(v, variant, stop // g.scale)
            for g, rk, v in zip(self.groups, self._keys, views, strict=True)
        ]
        for g, _, _ in targets:
            stats.add(f"group{g}_load_blocks", 1)
        first_group = targets[0][0] if targets else self.groups[0].group_id
        return (
            [memos[g][i] for g, i, _ in targets],
            [b for _, _, b in targets],
            sum(1 for g, _, _ in targets if g == first_group),
        )

    def store(
        self,
        request: Any,
        variant: bytes,
        tables: Sequence[Sequence[int]],
        start: int,
        stop: int,
        states: Sequence[Target] = (),
        *,
        final: bool = False,
    ) -> tuple[list[bytes], list[int], set[int], list[bytes | None]]:
        """(keys, GPU block ids, ids vLLM may hand out again while the request runs, chain
        parents) of the blocks [start, stop) each group still holds (out-of-window blocks are
        null: vLLM freed them), and of the Mamba boundary `states` (keyed by the hash of the
        block ending there).

        Parents: a full-attention block's is its group's previous block (the chain the object
        tier writes manifests for, so a lookup of the group's keys finds it). A sliding-window
        or state block has none: it is a chain of one, its own one-key manifest names it (one
        request finds it, and GC keeps it while lookups use it), as a sparse window or state
        chain could never be named by a reader that does not know which blocks were stored."""
        positional = store_targets(
            self.groups, tables, start, stop, interval=self._sliding_interval, final=final
        )
        targets = [*positional, *states]
        hashes = request.block_hashes

        def key(g: int, i: int) -> bytes:
            # Block i of a group of `scale` hash blocks is keyed by the hash ending at its end.
            return self.groups[g].namespace.key(hashes[(i + 1) * self.groups[g].scale - 1], variant)

        keys = [key(g, i) for g, i, _ in targets]
        parents = [
            key(g, i - 1) if i > 0 and self.groups[g].kind == "full" else None
            for g, i, _ in targets
        ]
        reused = {b for g, _, b in targets if self.groups[g].kind != "full"}
        return keys, [b for _, _, b in targets], reused, parents

    def planned_store(self, job: Any, reused: set[int], stats: FlexKVConnectorStats) -> None:
        """A store job was made: fence its sliding-window and state blocks, count its blocks
        per group."""
        self.fence.add(job.job_id, (b for b in job.gpu_block_ids or () if b in reused))
        for key in job.keys:
            gid = self._group_of.get(key[:PREFIX_LEN])
            if gid is not None:
                stats.add(f"group{gid}_store_blocks", 1)
