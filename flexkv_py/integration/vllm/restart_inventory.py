"""What survived a restart on every worker's SSD shard, gathered and then adopted by the index.

Each worker (one per (tp_rank, pp_rank): under PP every stage holds other layers of the same
blocks) reports the logical keys its SSD shard holds once, after register_kv_caches. A block can
be loaded only if every worker has its shard, so the scheduler gathers all tp_size x pp_size
reports and adopts the keys every one of them holds; a report keyed by TP rank alone would let
one stage's report replace another's, and a block one stage lost would be loaded and fail there.

Lookups never wait for it: until every report is in, those blocks are not in the index and
lookups miss them (0). Waiting ("ask again later", None) would stall serving: vLLM skips a
request that gets None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flexkv_py.integration.vllm.events import BlockOrigins, EventGroup
from flexkv_py.integration.vllm.recovered_events import RecoveredAnnouncer

WorkerRank = tuple[int, int]  # (tp_rank, pp_rank)

# Chain parents arrive with worker (0, 0)'s report (every worker holds the same chains).
PARENTS_RANK: WorkerRank = (0, 0)


class RestartInventory:
    def __init__(self, num_workers: int, *, enabled: bool) -> None:
        """`enabled`: an SSD tier exists (without one there is nothing to wait for)."""
        self._num_workers = num_workers
        self._reports: dict[WorkerRank, tuple[bytes, ...]] = {}
        self.ready = not enabled
        # The cache was reset before the reports were in: what they list predates the reset
        # and must be deleted, not adopted.
        self.stale = False
        # Logical key -> its chain parent's, from the reports (for prefix-aware adoption).
        self._parents: dict[bytes, bytes] = {}
        self._announcer: RecoveredAnnouncer | None = None

    def announce_with(
        self,
        origins: BlockOrigins,
        block_size: int,
        groups: Mapping[bytes, EventGroup] | None = None,
    ) -> None:
        """Publish the recovered blocks' origins (token ids...) once adopted (take_events);
        `groups`: each block's KV cache group by its key prefix (hybrid models)."""
        self._announcer = RecoveredAnnouncer(origins, block_size, groups)

    def adopt_reports(self, manager: Any, meta: Any) -> None:
        """Take a step's worker metadata (FlexKVWorkerMetadata): reports, parents, metas; adopt
        into `manager` (a CacheManager) once every worker reported."""
        ranks = self.add(meta.inventories, meta.inventory_parents)
        if ranks is not None:
            parents = self.take_parents()
            manager.adopt_ssd_keys(ranks, adopt=not self.stale, parents=parents)
        if self._announcer is not None and meta.recovered_metas and not self.stale:
            self._announcer.add(meta.recovered_metas)

    def take_events(self, known: Callable[[bytes], bool]) -> list[Any]:
        """BlockStored events for recovered blocks still `known`, once adopted."""
        if self._announcer is None or not self.ready:
            return []
        return self._announcer.take_events(True, known)

    def forget(self) -> None:
        """A cache reset: reports still to come list blocks to delete."""
        self.stale = not self.ready
        if self._announcer is not None:
            self._announcer.clear()

    def add(
        self,
        reports: Mapping[WorkerRank, tuple[bytes, ...]],
        parents: Mapping[bytes, bytes] | None = None,
    ) -> list[tuple[bytes, ...]] | None:
        """Take workers' reports; once every worker reported, return them (in rank order, for
        CacheManager.adopt_ssd_keys, which keeps the keys all of them hold) and become ready.
        `parents`: chain parents reported with them (then in `take_parents`)."""
        if self.ready:
            return None
        if parents:
            self._parents.update(parents)
        if not reports:
            return None
        self._reports.update(reports)
        if len(self._reports) < self._num_workers:
            return None
        self.ready = True
        ranks = [self._reports[r] for r in sorted(self._reports)]
        self._reports = {}
        return ranks

    def take_parents(self) -> dict[bytes, bytes]:
        """The chain parents of the reported blocks (once, at adoption)."""
        parents, self._parents = self._parents, {}
        return parents
