"""Sibling engines' SSD blocks (tiers/node/shards.py `SiblingShards`, `Tier.NODE`) as the
scheduler learns of them: every worker reports the keys that appeared and vanished in its
sibling shards since its last report; a key is offered once every worker (each TP/PP rank reads
its own rank's sibling shard) has reported it, and stops being offered as soon as one worker
reports it gone. Both directions ride the worker metadata of a step, never a wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexkv_py.index.tier_names import Tier

WorkerRank = tuple[int, int]


class NodeInventory:
    def __init__(self, num_workers: int) -> None:
        self._num_workers = num_workers
        # Keys some workers reported and others not yet: the ranks that did.
        self._partial: dict[bytes, set[WorkerRank]] = {}

    def apply(
        self,
        manager: Any,
        added: Mapping[WorkerRank, tuple[bytes, ...]],
        removed: Mapping[WorkerRank, tuple[bytes, ...]],
    ) -> tuple[int, int]:
        """Take one step's reports into `manager` (a CacheManager); (adopted, forgotten)."""
        gone = {k for keys in removed.values() for k in keys}
        for k in gone:
            self._partial.pop(k, None)
        forgotten = manager.forget_on(Tier.NODE, sorted(gone)) if gone else 0
        ready: list[bytes] = []
        for rank, keys in added.items():
            for k in keys:
                if k in gone:
                    continue
                ranks = self._partial.setdefault(k, set())
                ranks.add(rank)
                if len(ranks) >= self._num_workers:
                    del self._partial[k]
                    ready.append(k)
        adopted = manager.adopt_keys(Tier.NODE, [ready]) if ready else 0
        return adopted, forgotten
