"""Which blocks of a request a load takes: the external hit past its local GPU prefix, the keys
of that hit (to see whether another request is loading it already) and, once vLLM allocated the
blocks, the keys and GPU block ids the load job moves, per KV cache group for a hybrid model.

The load-side counterpart of store_planning.py: the scheduler side turns the plan into a job.
Kept apart so the scheduler side only sequences vLLM's calls, and the plain / hybrid choice
is made in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.errors import InternalStateError

if TYPE_CHECKING:
    from flexkv_py.integration.vllm.hybrid_plan import HybridPlan
    from flexkv_py.integration.vllm.request_keys import HashPrefixFn, RequestKeys
    from flexkv_py.integration.vllm.stats import FlexKVConnectorStats


class LoadPlanner:
    def __init__(self, keys: RequestKeys, hybrid: HybridPlan | None) -> None:
        self._keys = keys
        self._hybrid = hybrid

    def hit(self, request: Any, first: int, variant: bytes, readable: HashPrefixFn) -> int:
        """Blocks past `first` the tiers can restore (every group's, for a hybrid model)."""
        if self._hybrid is not None:
            return self._hybrid.hit(request, first, variant, readable)
        return self._keys.longest_hit(request, first, variant, readable)

    def hit_keys(self, request: Any, variant: bytes, first: int, stop: int) -> list[bytes]:
        """Keys of blocks [first, stop) (in every group, for a hybrid model)."""
        if self._hybrid is not None:
            return self._hybrid.prefix_keys(request, variant, first, stop)
        return self._keys.keys(request, variant, stop)[first:stop]

    def plan(
        self,
        request: Any,
        variant: bytes,
        tables: Sequence[Sequence[int]],
        first: int,
        count: int,
        stats: FlexKVConnectorStats,
    ) -> tuple[list[bytes], list[int], int]:
        """(keys, GPU block ids, blocks of the first group) a hit of `count` blocks from
        `first` loads into the request's allocated `tables` (one per group)."""
        if self._hybrid is not None:
            return self._hybrid.load(request, variant, tables, first, first + count, stats)
        block_ids = list(tables[0][first : first + count])
        keys = self._keys.keys(request, variant, first + count)[first : first + count]
        if len(block_ids) != count or len(keys) != count:
            raise InternalStateError(
                f"{request.request_id}: {count} blocks to load but {len(block_ids)} allocated"
            )
        return keys, block_ids, count
