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
fill, reset): the parent becomes a tail and evictable.

Lower tiers: the index decides every eviction (`_make_room`, before a write is begun), within
each tier's capacity in blocks (`set_lower_capacity`; the native store's own eviction is only a
safety net). Chains over all tiers: a block born with a parent (its first host fill, or a
restart's adoption with parents) is counted against it (`Entry.up`: the parent's 8-byte name,
`key_digest`); the count lives where the parent lives (`_kids` for warm blocks, the chain tier's
BlockSet for cold ones, moved along as a block warms or cools) and drops when the child leaves
every tier. The
spill tier keeps blocks that live nowhere else over second copies: a block leaving host evicts
the lower copies of idle host blocks first, then cold chain tails (blocks no cached child
depends on), least recently cooled first; a copy of a block that stays in host (write-behind,
write-through) takes only free room. So a full SSD holds what the host does not (hit rate:
21.7 % against 19.1 % on the Mooncake replay, benches/RESULTS.md 14), and a crash then loses
the host blocks whose copies gave way.
"""

from __future__ import annotations

from flexkv_py.index.cold_blocks import CHAIN_TIER, key_digest
from flexkv_py.index.entry import TIER_BIT, Entry, IndexStateError, tiers_of
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.index_reads import IndexReads
from flexkv_py.index.tier_names import Tier

# A full tier evicts at least 1/EVICT_BATCH of its capacity at once: one drop per batch of
# victims, not one per write.
EVICT_BATCH = 256

ColdState = tuple[int, bytes | None, int]  # ColdBlocks.take: mask, parent name, kids


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

    def _add(self, key: bytes, cold: ColdState | None = None) -> Entry:
        """A new entry for `key`; a cold block becomes warm (its lower-tier bits and chain
        links move over)."""
        lower, up, kids = self._cold.take(key) if cold is None else cold
        e = self._entries[key] = Entry(hits=self._ghost.pop(key, 0), lower=lower, up=up)
        self._heads.add(key, e)
        if kids:
            self._kids[key_digest(key)] = kids
        self._on_moved(0, lower)
        return e

    def _get(self, key: bytes) -> Entry:
        """The key's entry, warming a cold block; IndexStateError for an unknown key."""
        e = self._entries.get(key)
        if e is None:
            cold = self._cold.take(key)
            if not cold[0]:
                raise IndexStateError(f"unknown key {key.hex()}")
            e = self._add(key, cold)
        return e

    # --- lower-tier occupancy and eviction
    def _on_moved(self, before: int, after: int) -> None:
        """An entry's lower | pending mask went from `before` to `after`: keep the counts."""
        if before != after:
            for tier, bit in TIER_BIT.items():
                d = bool(after & bit) - bool(before & bit)
                if d:
                    self._warm_on[tier] += d

    def _make_room(self, tier: Tier, need: int, *, keeps_host: bool = False) -> bool:
        """Evict from `tier` until `need` more blocks fit its capacity; False if they cannot.
        `keeps_host`: the write copies a block that stays in host memory (write-behind,
        write-through): it only takes free room, since making room would drop a block that
        lives nowhere else for a second copy. Otherwise (a block leaving host) victims are,
        first, the lower copies of idle blocks that stay in host, newest first (they stay
        there longest); then cold chain tails. The victims wait for the manager to send their
        deletes: copies by key in `_lower_evicted`, cold tails by fingerprint in the cold
        blocks (`take_lower_drops`)."""
        cap = self._capacity.get(tier)
        if cap is None:
            return True
        over = self._warm_on[tier] + self._cold.count(tier) + need - cap
        if over <= 0:
            return True
        if keeps_host:
            return False
        evicted = self._lower_evicted.setdefault(tier, [])
        bit, entries = TIER_BIT[tier], self._entries
        copies: list[tuple[bytes, Entry]] = []
        for key in self._policy.newest():
            if len(copies) >= over:
                break
            assert isinstance(key, bytes)
            e = entries[key]
            if e.lower & bit and e.host_readable and not e.pins and not e.evicting:
                if not (self.keep_chains and key in self._children):  # else no longer evictable
                    copies.append((key, e))
        for key, e in copies:
            e.lower &= ~bit
            self._warm_on[tier] -= 1
            evicted.append(key)
            self._refresh(key, e)  # only a host copy now: chain rules apply to it again
        over -= len(copies)
        if over > 0 and tier is CHAIN_TIER:
            # Cold victims leave as fingerprints (`ColdBlocks.take_evicted`): the worker
            # resolves them to its keys.
            _, ups = self._cold.evict(max(over, cap // EVICT_BATCH))
            for up in ups:
                self._kid_dropped(up)
            over = self._warm_on[tier] + self._cold.count(tier) + need - cap
        return over <= 0

    # --- chains over all tiers
    def _kid_added(self, up: bytes) -> None:
        if not self._cold.add_kid(up):
            self._kids[up] = self._kids.get(up, 0) + 1

    def _kid_dropped(self, up: bytes) -> None:
        n = self._kids.get(up)
        if n is None:
            self._cold.drop_kid(up)
        elif n > 1:
            self._kids[up] = n - 1
        else:
            del self._kids[up]

    def _orphan(self, e: Entry) -> bool:
        """The block's chain parent left every tier: no prefix match reaches it any more, so
        it is not worth a lower-tier write. (A live parent holds the count of its children:
        `_kids` while warm, the chain set while cold.)"""
        up = e.up
        return up is not None and up not in self._kids and not self._cold.has_digest(up)

    def _born(self, e: Entry, parent: bytes | None) -> None:
        """A block cached for the first time: count it against its (cached) parent."""
        if parent is not None and (parent in self._entries or self._cold.has(parent)):
            e.up = key_digest(parent)
            self._kid_added(e.up)

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
            self._on_moved(e.lower | e.pending, e.pending)
            e.lower = 0
        self._refresh(key, e)
        if e.pins or e.host_slot is not None or e.pending:
            return
        if e.lower and not e.stale and len(key) > HEAD_LEN:
            # Only lower-tier copies left and nothing in flight: the block turns cold.
            self._policy.remove(key)
            del self._entries[key]
            self._heads.remove(key)
            self._on_moved(e.lower, 0)
            d = key_digest(key)
            kids = self._kids.pop(d, 0)
            if not self._cold.add(key, e.lower, e.up, kids) and kids:
                self._kids[d] = kids  # not cold on the chain tier: its count stays here
            self._remember_hits(key, e.hits)
        elif not e.lower:
            self._policy.remove(key)
            del self._entries[key]
            self._heads.remove(key)
            if not e.stale:
                self._remember_hits(key, e.hits)
                if e.up is not None:  # left every tier: its parent loses a cached child
                    self._kid_dropped(e.up)
                # Its cached children (if any) are orphans now: forget its count, so that
                # they are seen as such (`_orphan`).
                self._kids.pop(key_digest(key), None)
