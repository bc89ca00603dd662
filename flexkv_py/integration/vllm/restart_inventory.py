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

from collections.abc import Mapping

WorkerRank = tuple[int, int]  # (tp_rank, pp_rank)


class RestartInventory:
    def __init__(self, num_workers: int, *, enabled: bool) -> None:
        """`enabled`: an SSD tier exists (without one there is nothing to wait for)."""
        self._num_workers = num_workers
        self._reports: dict[WorkerRank, tuple[bytes, ...]] = {}
        self.ready = not enabled
        # The cache was reset before the reports were in: what they list predates the reset
        # and must be deleted, not adopted.
        self.stale = False

    def forget(self) -> None:
        """A cache reset: reports still to come list blocks to delete."""
        self.stale = not self.ready

    def add(
        self, reports: Mapping[WorkerRank, tuple[bytes, ...]]
    ) -> list[tuple[bytes, ...]] | None:
        """Take workers' reports; once every worker reported, return them (in rank order, for
        CacheManager.adopt_ssd_keys, which keeps the keys all of them hold) and become ready."""
        if self.ready or not reports:
            return None
        self._reports.update(reports)
        if len(self._reports) < self._num_workers:
            return None
        self.ready = True
        ranks = [self._reports[r] for r in sorted(self._reports)]
        self._reports = {}
        return ranks
