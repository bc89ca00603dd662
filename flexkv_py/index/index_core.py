"""The tier index's state and shared helpers (lock held): entries warm and cool, evictability,
chains.

Prefix-aware eviction. A prefix match stops at the first miss, so a block whose child is cached
must outlive it: chains leave the host tier from their tail, as vLLM's own prefix cache frees
blocks. Keys enter with an optional parent (`begin_host_fills(parents=...)`: consecutive keys of
one request form a chain). While a block's host copy is held (filling, ready, evicting) and it
has a parent, it is counted in `children[parent]` and `Entry.parent` names that parent; a block
with a count and no lower-tier copy is never handed to the eviction policy (leaving host would
lose it while its child stays), so the policy holds only chain tails and blocks that stay cached
below (a parent already written to the SSD may leave host first, it still matches), and a victim
is still chosen in O(1). The count drops when the child's host copy goes (evicted, failed
fill, reset): the parent becomes a tail and evictable.

Lower tiers: the index decides every eviction (lower_room.py `make_room`, before a write is
begun), within each tier's capacity in blocks (`set_lower_capacity`; the native store's own
eviction is only a safety net). Chains over all tiers: a block born with a parent (its first
host fill, or a restart's adoption with parents) is counted against it (`Entry.up`: the
parent's 8-byte name, `key_digest`); the count lives where the parent lives (`kids` for warm
blocks, the chain tier's BlockSet for cold ones, moved along as a block warms or cools) and
drops when the child leaves every tier. The spill tier keeps blocks that live nowhere else over
second copies: a block leaving host evicts the lower copies of idle host blocks first, then
cold chain tails (blocks no cached child depends on), least recently cooled first; a copy of a
block that stays in host (write-behind, write-through) takes only free room. So a full SSD
holds what the host does not (hit rate: 21.7 % against 19.1 % on the Mooncake replay,
benches/RESULTS.md 14), and a crash then loses the host blocks whose copies gave way.
"""

from __future__ import annotations

from collections import OrderedDict

from flexkv_py.index.cold_blocks import ColdBlocks, key_digest
from flexkv_py.index.entry import TIER_BIT, Entry, IndexStateError, tiers_of
from flexkv_py.index.head_map import HEAD_LEN, HeadMap
from flexkv_py.index.host_slots import HostSlots
from flexkv_py.index.policies import EvictionPolicy
from flexkv_py.index.tier_names import LOWER_TIERS, Tier

ColdState = tuple[int, bytes | None, int]  # ColdBlocks.take: mask, parent name, kids


class IndexCore:
    """The index's state and what every part of it shares: the entries (warm blocks) with their
    per-head view, the cold blocks, the host slots, the eviction policy, the chain counts, the
    ghost counts; entry lifecycle, policy upkeep, chain counts.

    Not locked: `TierIndex` owns it and its lock, and its parts (IndexReads, LowerRoom,
    HostFills) and its own transitions call it under that lock. The parts keep references to
    the containers below (a read binds them once, not per call), so they are created here once
    and only changed in place, never replaced, for the index's lifetime."""

    def __init__(
        self,
        slots: HostSlots,
        cold: ColdBlocks,
        policy: EvictionPolicy,
        *,
        keep_chains: bool,
        ghost_capacity: int,
    ) -> None:
        """`keep_chains`: host eviction goes tail-first along chains; False where every victim
        is written to a lower tier anyway (it stays matchable), so plain policy order is best.
        `ghost_capacity`: how many dropped keys' access counts are remembered."""
        self.slots = slots
        self.cold = cold
        self.cold_live = cold.live  # empty: no cold block, a miss asks no set
        self.policy = policy
        self.keep_chains = keep_chains
        self.entries: dict[bytes, Entry] = {}
        self.heads: HeadMap[Entry] = HeadMap()  # what `readable_hashes` reads
        self.by_head = self.heads.by_head
        # Chain parent -> how many of its children hold a host copy (a parent with a count is
        # no chain tail, so never evictable).
        self.children: dict[bytes, int] = {}
        # Chains over every tier: digest of a warm (or object-only) block -> cached children
        # counted against it (a cold block's count is in the chain tier's set).
        self.kids: dict[bytes, int] = {}
        # Per lower tier, blocks on it or being written there among the entries (the cold sets
        # count theirs): what its capacity is checked against (lower_room.py).
        self.warm_on: dict[Tier, int] = dict.fromkeys(LOWER_TIERS, 0)
        # Copies of stale keys on lower tiers, to be deleted (`take_garbage`).
        self.garbage: dict[Tier, list[bytes]] = {}
        # Access counts of recently dropped keys, so min_hits admission sees returning blocks.
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_capacity = ghost_capacity

    def take_garbage(self) -> dict[Tier, list[bytes]]:
        """Per lower tier, copies of stale keys that must be deleted (since the last call)."""
        out = dict(self.garbage)
        self.garbage.clear()
        return out

    def unlink(self, e: Entry) -> None:
        """The block's host copy is gone: its parent loses a cached child (maybe a tail now)."""
        parent = e.parent
        if parent is None:
            return
        e.parent = None
        left = self.children[parent] - 1
        if left:
            self.children[parent] = left
            return
        del self.children[parent]
        pe = self.entries.get(parent)
        if pe is not None and pe.evictable and not pe.lower and parent not in self.policy:
            # The chain's new tail goes next (it was used with the child that just left).
            self.policy.add_oldest(parent, pe.hits)

    def link(self, e: Entry, parent: bytes) -> None:
        """The block (its host copy just begun) is `parent`'s child: the parent is no tail."""
        e.parent = parent
        self.children[parent] = self.children.get(parent, 0) + 1
        pe = self.entries.get(parent)
        if pe is None or not pe.lower:
            self.policy.remove(parent)

    def add(self, key: bytes, cold: ColdState | None = None) -> Entry:
        """A new entry for `key`; a cold block becomes warm (its lower-tier bits and chain
        links move over)."""
        lower, up, kids = self.cold.take(key) if cold is None else cold
        e = self.entries[key] = Entry(hits=self.ghost.pop(key, 0), lower=lower, up=up)
        self.heads.add(key, e)
        if kids:
            self.kids[key_digest(key)] = kids
        self.on_moved(0, lower)
        return e

    def get(self, key: bytes) -> Entry:
        """The key's entry, warming a cold block; IndexStateError for an unknown key."""
        e = self.entries.get(key)
        if e is None:
            cold = self.cold.take(key)
            if not cold[0]:
                raise IndexStateError(f"unknown key {key.hex()}")
            e = self.add(key, cold)
        return e

    # --- lower-tier occupancy
    def on_moved(self, before: int, after: int) -> None:
        """An entry's lower | pending mask went from `before` to `after`: keep the counts."""
        if before != after:
            for tier, bit in TIER_BIT.items():
                d = bool(after & bit) - bool(before & bit)
                if d:
                    self.warm_on[tier] += d

    # --- chains over all tiers
    def kid_added(self, up: bytes) -> None:
        if not self.cold.add_kid(up):
            self.kids[up] = self.kids.get(up, 0) + 1

    def kid_dropped(self, up: bytes) -> None:
        n = self.kids.get(up)
        if n is None:
            self.cold.drop_kid(up)
        elif n > 1:
            self.kids[up] = n - 1
        else:
            del self.kids[up]

    def orphan(self, e: Entry) -> bool:
        """The block's chain parent left every tier: no prefix match reaches it any more, so
        it is not worth a lower-tier write. (A live parent holds the count of its children:
        `kids` while warm, the chain set while cold.)"""
        up = e.up
        return up is not None and up not in self.kids and not self.cold.has_digest(up)

    def born(self, e: Entry, parent: bytes | None) -> None:
        """A block cached for the first time: count it against its (cached) parent."""
        if parent is not None and (parent in self.entries or self.cold.has(parent)):
            e.up = key_digest(parent)
            self.kid_added(e.up)

    def remember_hits(self, key: bytes, hits: int) -> None:
        if self.ghost_capacity > 0:
            self.ghost[key] = hits
            self.ghost.move_to_end(key)
            while len(self.ghost) > self.ghost_capacity:
                self.ghost.popitem(last=False)

    def refresh(self, key: bytes, e: Entry) -> None:
        if e.evictable and (e.lower or key not in self.children):
            if key not in self.policy:
                self.policy.add(key, e.hits)
        else:
            self.policy.remove(key)

    def settle(self, key: bytes, e: Entry) -> None:
        """Release what an entry no longer needs, then drop the entry if nothing is left."""
        if e.releasing and e.pins == 0:
            assert e.host_slot is not None
            self.slots.give(e.host_slot)
            e.host_slot, e.releasing = None, False
            self.unlink(e)
        if e.stale and e.pins == 0 and not e.evicting:
            if e.host_slot is not None and e.host_ready:
                self.slots.give(e.host_slot)
                e.host_slot, e.host_ready = None, False
                self.unlink(e)
            for tier in tiers_of(e.lower):
                self.garbage.setdefault(tier, []).append(key)
            self.on_moved(e.lower | e.pending, e.pending)
            e.lower = 0
        self.refresh(key, e)
        if e.pins or e.host_slot is not None or e.pending:
            return
        if e.lower and not e.stale and len(key) > HEAD_LEN:
            # Only lower-tier copies left and nothing in flight: the block turns cold.
            self.policy.remove(key)
            del self.entries[key]
            self.heads.remove(key)
            self.on_moved(e.lower, 0)
            d = key_digest(key)
            kids = self.kids.pop(d, 0)
            if not self.cold.add(key, e.lower, e.up, kids) and kids:
                self.kids[d] = kids  # not cold on the chain tier: its count stays here
            self.remember_hits(key, e.hits)
        elif not e.lower:
            self.policy.remove(key)
            del self.entries[key]
            self.heads.remove(key)
            if not e.stale:
                self.remember_hits(key, e.hits)
                if e.up is not None:  # left every tier: its parent loses a cached child
                    self.kid_dropped(e.up)
                # Its cached children (if any) are orphans now: forget its count, so that
                # they are seen as such (`orphan`).
                self.kids.pop(key_digest(key), None)
