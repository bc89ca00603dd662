"""The tier index's internal helpers (lock held): entries warm and cool, evictability, chains.

Prefix-aware eviction. A prefix match stops at the first miss, so a block whose child is cached
must outlive it: chains leave the host tier from their tail, as vLLM's own prefix cache frees
blocks. Keys enter with an optional parent (`begin_host_fills(parents=...)`: consecutive keys of
one request form a chain). While a block's host copy is held (filling, ready, evicting) and it
has a parent, it is counted in `_children[parent]` and `Entry.parent` names that parent; a block
with a count and no lower-tier copy is never handed to the eviction policy (leaving host would
lose it while its child stays), so the policy holds only chain tails and blocks that stay cached
below (a parent already written to the SSD may leave host first, it still matches), and a victim
is still chosen in O(1). The count drops when the child's host copy goes (evicted, failed
fill, reset): the parent becomes a tail and evictable. Only host copies are counted: cold blocks
(lower-tier only, a digest in a BlockSet) keep no link at all, 0 extra bytes, and the lower
tiers' own order (the native store's) decides what leaves them.
"""

from __future__ import annotations

from flexkv_py.index.entry import Entry, IndexStateError, tiers_of
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.index_reads import IndexReads


class IndexCore(IndexReads):
    """What the transitions (TierIndex) share: entry lifecycle, policy upkeep, chain counts."""

    def _unlink(self, e: Entry) -> None:
        """The block's host copy is gone: its parent loses a cached child (maybe a tail now)."""
        parent = e.parent
        if parent is None:
            return
        e.parent = None
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        pe = self._entries.get(parent)
        if pe is not None and pe.evictable and not pe.lower and parent not in self._policy:
            # The chain's new tail goes next (it was used with the child that just left).
            self._policy.add_oldest(parent, pe.hits)

    def _link(self, e: Entry, parent: bytes) -> None:
        """The block (its host copy just begun) is `parent`'s child: the parent is no tail."""
        e.parent = parent
        self._children[parent] = self._children.get(parent, 0) + 1
        pe = self._entries.get(parent)
        if pe is None or not pe.lower:
            self._policy.remove(parent)

    def _add(self, key: bytes, lower: int | None = None) -> Entry:
        """A new entry for `key`; a cold block becomes warm (its lower-tier bits move over)."""
        if lower is None:
            lower = self._cold.take(key)
        e = self._entries[key] = Entry(hits=self._ghost.pop(key, 0), lower=lower)
        self._heads.add(key, e)
        return e

    def _get(self, key: bytes) -> Entry:
        """The key's entry, warming a cold block; IndexStateError for an unknown key."""
        e = self._entries.get(key)
        if e is None:
            lower = self._cold.take(key)
            if not lower:
                raise IndexStateError(f"unknown key {key.hex()}")
            e = self._add(key, lower)
        return e

    def _remember_hits(self, key: bytes, hits: int) -> None:
        if self._ghost_capacity > 0:
            self._ghost[key] = hits
            self._ghost.move_to_end(key)
            while len(self._ghost) > self._ghost_capacity:
                self._ghost.popitem(last=False)

    def _refresh(self, key: bytes, e: Entry) -> None:
        if e.evictable and (e.lower or key not in self._children):
            if key not in self._policy:
                self._policy.add(key, e.hits)
        else:
            self._policy.remove(key)

    def _settle(self, key: bytes, e: Entry) -> None:
        """Release what an entry no longer needs, then drop the entry if nothing is left."""
        if e.releasing and e.pins == 0:
            assert e.host_slot is not None
            self._slots.give(e.host_slot)
            e.host_slot, e.releasing = None, False
            self._unlink(e)
        if e.stale and e.pins == 0 and not e.evicting:
            if e.host_slot is not None and e.host_ready:
                self._slots.give(e.host_slot)
                e.host_slot, e.host_ready = None, False
                self._unlink(e)
            for tier in tiers_of(e.lower):
                self._garbage.setdefault(tier, []).append(key)
            e.lower = 0
        self._refresh(key, e)
        if e.pins or e.host_slot is not None or e.pending:
            return
        if e.lower and not e.stale and len(key) > HEAD_LEN:
            # Only lower-tier copies left and nothing in flight: the block turns cold.
            self._policy.remove(key)
            del self._entries[key]
            self._heads.remove(key)
            self._cold.add(key, e.lower)
            self._remember_hits(key, e.hits)
        elif not e.lower:
            self._policy.remove(key)
            del self._entries[key]
            self._heads.remove(key)
            if not e.stale:
                self._remember_hits(key, e.hits)
