"""The tier index's lower-tier room: each tier's capacity and occupancy, the evictions the index
chooses before it begins a write (`make_room`) and hands out for the manager to delete, what a
reset forgot of the cold blocks, and chain links of blocks adopted at a restart. The chain rules
(chains over all tiers) are in index_core.py; `TierIndex` (tier_index.py) owns this part and
the transitions that call `make_room`. Every public method takes the index's one lock."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from flexkv_py.index.cold_blocks import CHAIN_TIER, Forgotten
from flexkv_py.index.entry import TIER_BIT, Entry
from flexkv_py.index.index_core import IndexCore
from flexkv_py.index.joined_keys import JoinedLinks
from flexkv_py.index.tier_names import Tier

# A full tier evicts at least 1/EVICT_BATCH of its capacity at once: one drop per batch of
# victims, not one per write.
EVICT_BATCH = 256


class LowerRoom:
    def __init__(self, lock: threading.Lock, core: IndexCore) -> None:
        self._lock = lock
        self._core = core
        self._entries = core.entries
        self._cold = core.cold
        self._warm_on = core.warm_on
        # Per tier, blocks it may hold (absent: unbounded); victims chosen whose deletes the
        # manager has not taken.
        self._capacity: dict[Tier, int] = {}
        self._lower_evicted: dict[Tier, list[bytes]] = {}

    def link_parents(self, parents: Mapping[bytes, bytes]) -> int:
        """Chain links of blocks adopted at a restart (child key -> parent key, both cached):
        each child is counted against its parent, so eviction stays tail-first. Returns how
        many links were made; children linked already, or whose parent is not cached, are
        skipped."""
        if isinstance(parents, JoinedLinks):
            with self._lock:
                if not self._entries:  # a restart's first adoption: every block is cold
                    return self._cold.link_joined(parents.children, parents.parents)
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
                        self._core.born(e, parent)
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
                self.make_room(tier, 0)

    def fit_lower_capacity(self, tier: Tier) -> None:
        """Evict down to `tier`'s capacity (a restart adopted a store larger than it is now)."""
        with self._lock:
            self.make_room(tier, 0)

    def make_room(self, tier: Tier, need: int, *, keeps_host: bool = False) -> bool:
        """Evict from `tier` until `need` more blocks fit its capacity; False if they cannot.
        `keeps_host`: the write copies a block that stays in host memory (write-behind,
        write-through): it only takes free room, since making room would drop a block that
        lives nowhere else for a second copy. Otherwise (a block leaving host) victims are,
        first, the lower copies of idle blocks that stay in host, newest first (they stay
        there longest); then cold chain tails. The victims wait for the manager to send their
        deletes: copies by key in `_lower_evicted`, cold tails by fingerprint in the cold
        blocks (`take_lower_drops`). Lock held."""
        cap = self._capacity.get(tier)
        if cap is None:
            return True
        over = self._warm_on[tier] + self._cold.count(tier) + need - cap
        if over <= 0:
            return True
        if keeps_host:
            return False
        core = self._core
        evicted = self._lower_evicted.setdefault(tier, [])
        bit, entries = TIER_BIT[tier], core.entries
        copies: list[tuple[bytes, Entry]] = []
        for key in core.policy.newest():
            if len(copies) >= over:
                break
            assert isinstance(key, bytes)
            e = entries[key]
            if e.lower & bit and e.host_readable and not e.pins and not e.evicting:
                if not (core.keep_chains and key in core.children):  # else no longer evictable
                    copies.append((key, e))
        for key, e in copies:
            e.lower &= ~bit
            self._warm_on[tier] -= 1
            evicted.append(key)
            core.refresh(key, e)  # only a host copy now: chain rules apply to it again
        over -= len(copies)
        if over > 0 and tier is CHAIN_TIER:
            # Cold victims leave as fingerprints (`ColdBlocks.take_evicted`): the worker
            # resolves them to its keys.
            _, ups = self._cold.evict(max(over, cap // EVICT_BATCH))
            for up in ups:
                core.kid_dropped(up)
            over = self._warm_on[tier] + self._cold.count(tier) + need - cap
        return over <= 0

    def occupancy(self, tier: Tier) -> int:
        """Blocks on `tier` or being written there: what its capacity is checked against."""
        with self._lock:
            return self._warm_on[tier] + self._cold.count(tier)

    def lower_capacity(self, tier: Tier) -> int | None:
        with self._lock:
            return self._capacity.get(tier)

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
