"""The tier index's lower-tier room, public side: each tier's capacity, the evictions the index
chose (for the manager to delete), and chain links of blocks adopted at a restart. The rules
(`_make_room`, chains over all tiers) are in index_core.py; `TierIndex` (tier_index.py) adds the
rest of the transitions. Every method takes the one lock."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flexkv_py.index.cold_blocks import CHAIN_TIER, Forgotten
from flexkv_py.index.index_core import IndexCore
from flexkv_py.index.tier_names import Tier


class LowerRoom(IndexCore):
    def link_parents(self, parents: Mapping[bytes, bytes]) -> int:
        """Chain links of blocks adopted at a restart (child key -> parent key, both cached):
        each child is counted against its parent, so eviction stays tail-first. Returns how
        many links were made; children linked already, or whose parent is not cached, are
        skipped."""
        with self._lock:
            cold_kids: list[bytes] = []
            cold_ups: list[bytes] = []
            made = 0
            entries = self._entries
            for child, parent in parents.items():
                if child == parent:
                    continue
                e = entries.get(child)
                if e is not None:
                    if e.up is None and e.readable:
                        self._born(e, parent)
                        made += e.up is not None
                elif parent not in entries:
                    cold_kids.append(child)
                    cold_ups.append(parent)
            if cold_kids:
                made += self._cold.link(cold_kids, cold_ups)
            return made

    def set_lower_capacity(self, tier: Tier, blocks: int | None) -> None:
        """How many blocks `tier` holds (None: unbounded, its store evicts on its own). The
        index then chooses every eviction there before it begins a write (`take_lower_
        evictions` hands out the deletes); a full tier evicts at once."""
        if blocks is not None and blocks < 0:
            raise ValueError(f"capacity of {tier.value}: must be >= 0 blocks, got {blocks}")
        with self._lock:
            if blocks is None:
                self._capacity.pop(tier, None)
            else:
                self._capacity[tier] = blocks
                self._make_room(tier, 0)

    def fit_lower_capacity(self, tier: Tier) -> None:
        """Evict down to `tier`'s capacity (a restart adopted a store larger than it is now)."""
        with self._lock:
            self._make_room(tier, 0)

    def take_lower_evictions(self) -> dict[Tier, list[bytes]]:
        """Per lower tier, the blocks the index evicted by key since the last call: gone from
        the index already, their deletes must reach the tier before any write that needs the
        room (the manager sends them first in the next job). Cold victims: `take_lower_drops`."""
        with self._lock:
            out, self._lower_evicted = self._lower_evicted, {}
            return {t: keys for t, keys in out.items() if keys}

    def take_lower_drops(self) -> tuple[dict[Tier, list[bytes]], dict[Tier, bytes]]:
        """Every lower-tier eviction since the last call: (keys per tier, as
        `take_lower_evictions`; joined 8-byte fingerprints per tier of the cold blocks evicted,
        which the worker resolves to its keys)."""
        with self._lock:  # not re-entrant: both taken under one hold
            prints = self._cold.take_evicted()
            out, self._lower_evicted = self._lower_evicted, {}
            keys = {t: keys for t, keys in out.items() if keys}
            return keys, ({CHAIN_TIER: prints} if prints else {})

    def take_forgotten(self) -> list[Forgotten]:
        """What the resets since the last call cleared of the cold blocks (`Forgotten`): which
        of the keys a worker's namespace delete reports the index held."""
        with self._lock:
            return self._cold.take_forgotten()

    def cold_keys_among(self, candidates: Iterable[bytes]) -> list[bytes]:
        """The candidates the index holds cold (cold keys are fingerprints: not listable)."""
        with self._lock:
            return self._cold.keys_among(candidates)
