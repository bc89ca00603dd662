"""Which blocks of a request a store takes once a step ran: its full blocks past those already
planned, per KV cache group for a hybrid model (plus the Mamba boundary states vLLM handed off),
with their keys. The scheduler side turns the plan into a job."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexkv_py.index.namespace import Namespace
    from flexkv_py.integration.vllm.hybrid_plan import HybridPlan
    from flexkv_py.integration.vllm.request_state import RequestState

logger = logging.getLogger(__name__)


@dataclass
class StorePlan:
    start: int  # first block position planned now
    stop: int  # positions [start, stop) are planned (stored, skipped or in flight) after it
    keys: list[bytes]
    gpu_ids: list[int]
    # GPU blocks vLLM may hand out again while the request runs (sliding window, Mamba state).
    reused: set[int] = field(default_factory=set)
    # Chain parent of keys[0] (the key of block start - 1), so the index links this store to
    # the prefix before it (prefix-aware eviction); None: the chain starts here, or hybrid.
    first_parent: bytes | None = None
    # Every key's chain parent (hybrid: per group, hybrid_plan.store); None: from first_parent.
    parents: list[bytes | None] | None = None


class StorePlanner:
    def __init__(
        self,
        ns: Namespace,
        block_size: int,
        hybrid: HybridPlan | None,
        block_tables: Callable[[str], Sequence[Sequence[int]]],
    ) -> None:
        self._ns = ns
        self._bs = block_size
        self._hybrid = hybrid
        self._tables = block_tables  # req_id -> the request's block ids per group

    def plan(
        self,
        state: RequestState,
        tokens_with_kv: int,
        variant: bytes,
        block_ids: Sequence[Sequence[int]] | None = None,
        *,
        final: bool = False,
    ) -> StorePlan | None:
        """Blocks whose KV exists once `tokens_with_kv` tokens are computed and that are not
        planned yet (`block_ids`: the request's tables, the manager's when None); advances
        `state.planned_blocks`; `final`: the request's last plan. None when there is nothing
        new."""
        req = state.request
        full = min(tokens_with_kv // self._bs, len(req.block_hashes))
        start = state.planned_blocks
        hybrid = self._hybrid
        states: list[Any] = []
        if hybrid is not None:
            states = hybrid.states.take(req.request_id, tokens_with_kv, full)
        if full <= start and not states and not (final and hybrid is not None):
            return None
        full = state.planned_blocks = max(start, full)
        tables = block_ids or self._tables(req.request_id)
        if hybrid is not None:
            keys, gpu_ids, reused, parents = hybrid.store(
                req, variant, tables, start, full, states, final=final
            )
            if not keys:
                return None
            return StorePlan(start, full, keys, gpu_ids, reused, parents=parents)
        gpu_ids = list(tables[0][start:full])
        hashes = req.block_hashes[start:full]
        if len(gpu_ids) != len(hashes):
            logger.warning("%s: %d hashes but %d blocks", req.request_id, len(hashes), len(gpu_ids))
            return None
        keys = self._ns.keys(req.block_hashes[max(start - 1, 0) : full], variant)
        parent = keys.pop(0) if start > 0 else None
        return StorePlan(start, full, keys, gpu_ids, first_parent=parent)
