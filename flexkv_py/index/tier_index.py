"""Tier index: logical key -> where the block lives (host slot, lower tiers: SSD, object store).

Source of truth. What the scheduler may promise is decided here and nowhere else: a lookup hit,
a load's source tier, an eviction and the KV events all read this index. It also decides every
lower-tier eviction: it knows each tier's capacity in blocks (`set_lower_capacity`, from the
store's on-disk layout: lower_capacity.py) and chooses victims before it begins a write
(lower_room.py `make_room`); their deletes travel first in the job that needs the room
(`drop_first`). The worker-side stores hold the bytes and may still lose them (device errors;
their own capacity eviction, a safety net that fires only if sizes are wrong); they report each
loss (`JobResult.evicted`, a failed read) and the index forgets the copy. The index, not the
stores, is the truth because only it sees every tier at once and every job in flight: pins,
pending writes and stale (reset) keys exist nowhere else, and the next features need exactly
that view: parent links for prefix-aware eviction (the order blocks may leave in), write-behind
(a host copy with a `pending` write to a lower tier), and presence in an object tier shared by
the fleet (one more bit of `Entry.lower`; no state or query names a tier). The stores' own
indexes answer only "where on my device are these bytes"; restart rebuilds this index from what
every rank's store still holds (`set_present`).

States of one key's host copy::

    (none) --begin_host_fill--> filling --commit_host_fill(ok)--> ready --begin_evict--> evicting
      ^                            |                                                        |
      +---commit_host_fill(fail)---+          finish_evict, pinned: releasing <-------------+
      +------------------------- finish_evict, unpinned / last unpin of releasing ----------+

Per lower tier a key is absent, pending (`begin_write`), or present (`commit_write(ok)`,
`set_present`). Readable (counted by `match`): ready and evicting host copies (an evicting copy
is being written to a lower tier; its slot is reused only after that), and confirmed lower-tier
copies. Filling and releasing copies never are, so a lookup never promises bytes that are not
there. Pins (refcounts) protect blocks used by in-flight jobs: a releasing slot is freed by the
last unpin. A block is evictable exactly when its host copy is ready, unpinned and not already
evicting; the eviction policy tracks only evictable keys, so choosing a victim is O(1). Every
public method takes one lock: thread-safe.

Warm and cold. A block with a host copy, a pin or a write in flight is an `Entry` (warm); one
that only has lower-tier copies is cold: an 8-byte digest in a per-tier `BlockSet`
(cold_blocks.py), ~70 B instead of ~200, so a tier of millions of blocks fits the budget of 100 B
per block. `IndexCore.add` / `get` warm a cold block (a load pins it, a write to another tier
starts); `settle` cools an entry that has nothing but lower-tier copies left. Queries read both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import cast

from flexkv_py.index.cold_blocks import ColdBlocks
from flexkv_py.index.entry import TIER_BIT, Entry, IndexStateError, Located, Victim, tiers_of
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.host_fills import HostFills
from flexkv_py.index.host_slots import HostSlots
from flexkv_py.index.index_core import IndexCore
from flexkv_py.index.index_reads import IndexReads
from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.lower_room import LowerRoom
from flexkv_py.index.policies import EvictionPolicy, LRUPolicy
from flexkv_py.index.tier_names import Tier

__all__ = ["HEAD_LEN", "Entry", "IndexStateError", "Located", "Tier", "TierIndex", "Victim"]


class TierIndex:
    """Key -> location map plus the host slot allocator. It owns one lock and its parts: the
    state and the helpers every part shares (`IndexCore`, index_core.py), the queries
    (`reads`: IndexReads, index_reads.py), the lower tiers' capacity, evictions and adopted
    links (`room`: LowerRoom, lower_room.py) and the host fills begun and committed in batches
    (`fills`: HostFills, host_fills.py); the other transitions are its own methods, below. The
    parts' public methods are bound onto it, so callers see one API and a call costs no extra
    frame (lookups are on the scheduler's hot path).

    Host slots are owned here so that "who holds slot N" has one answer: a slot is either free or
    held by exactly one key (filling, ready or evicting). Slots and lower-tier copies that became
    garbage (failed fills, finished evictions, reset of blocks that were in use) are queued and
    handed to the manager by `take_garbage`.
    """

    def __init__(
        self,
        num_host_slots: int,
        eviction: EvictionPolicy | None = None,
        ghost_capacity: int | None = None,
        usable_host_slots: int | None = None,
        *,
        keep_chains: bool = True,
    ) -> None:
        """`usable_host_slots`: how many leading slots may be handed out now (default all); a
        pool prepared in the background grows it with `grow_usable_slots`. `keep_chains`: host
        eviction goes tail-first along chains (index_core.py); False where every victim is
        written to a lower tier anyway (it stays matchable), so plain policy order is best."""
        if ghost_capacity is None:
            ghost_capacity = max(1024, num_host_slots)
        core = IndexCore(
            HostSlots(num_host_slots, usable_host_slots),
            ColdBlocks(),
            eviction or LRUPolicy(),
            keep_chains=keep_chains,
            ghost_capacity=ghost_capacity,
        )
        self._lock = lock = threading.Lock()
        self._core = core
        self.reads = reads = IndexReads(lock, core)
        self.room = room = LowerRoom(lock, core)
        self.fills = fills = HostFills(lock, core)
        self.keep_chains = keep_chains
        self.num_host_slots = num_host_slots
        # The core's containers the transitions below use, bound once (they live as long as
        # the index, changed in place only).
        self._entries = core.entries
        self._cold = core.cold
        self._policy = core.policy
        self._slots = core.slots
        self._children = core.children
        self._kids = core.kids
        self._ghost = core.ghost
        self._warm_on = core.warm_on
        # --- the parts' public methods (each takes the lock) ---
        # queries (index_reads.py)
        self.match = reads.match
        self.lookup = reads.lookup
        self.readable_prefix = reads.readable_prefix
        self.readable_hashes = reads.readable_hashes
        self.known = reads.known
        self.known_many = reads.known_many
        self.entry = reads.entry
        self.host_slot_of = reads.host_slot_of
        self.hits = reads.hits
        self.keys = reads.keys
        self.loadable = reads.loadable
        self.counts = reads.counts
        self.kids = reads.kids
        self.readable_on = reads.readable_on
        self.lacking_on = reads.lacking_on
        # lower-tier room (lower_room.py)
        self.link_parents = room.link_parents
        self.set_lower_capacity = room.set_lower_capacity
        self.fit_lower_capacity = room.fit_lower_capacity
        self.occupancy = room.occupancy
        self.lower_capacity = room.lower_capacity
        self.take_lower_evictions = room.take_lower_evictions
        self.take_lower_drops = room.take_lower_drops
        self.take_forgotten = room.take_forgotten
        self.cold_keys_among = room.cold_keys_among
        # host fills (host_fills.py)
        self.begin_host_fill = fills.begin_host_fill
        self.begin_host_fills = fills.begin_host_fills
        self.commit_host_fill = fills.commit_host_fill
        self.commit_host_fills = fills.commit_host_fills

    def __len__(self) -> int:
        return len(self.reads)

    @property
    def free_slots(self) -> int:
        return self.reads.free_slots

    @property
    def usable_host_slots(self) -> int:
        return self.reads.usable_host_slots

    def acquire(self, keys: Sequence[bytes], *, count_hits: bool = False) -> list[Located]:
        """`match` and pin the matched keys in one step, so none can be evicted in between.
        `count_hits`: also record a hit on each (as `touch`; recency is refreshed at unpin)."""
        out: list[Located] = []
        host = Tier.HOST
        located = tuple.__new__  # Located(...) without its Python-level __new__: per block
        with self._lock:
            entries, remove = self._entries, self._policy.remove
            for key in keys:
                e = entries.get(key)
                if e is None:  # a cold block? it warms up to be pinned
                    cold = self._cold.take(key)
                    if not cold[0]:
                        break
                    e = self._core.add(key, cold)
                if e.host_ready and not e.stale:  # e.best_tier() inlined: the common case
                    out.append(located(Located, (host, e.host_slot)))
                else:
                    tier = e.best_tier()
                    if tier is None:
                        break
                    out.append(Located(tier, None))
                e.pins += 1
                if count_hits:
                    e.hits += 1
                remove(key)
        return out

    def acquire_host(self, keys: Sequence[bytes], *, count_hits: bool = False) -> list[int] | None:
        """`acquire` when every key is readable from host memory (a load of host blocks): their
        slots, pinned, with no `Located` per block. None, pinning nothing, if any key is not
        (the caller asks `acquire`)."""
        with self._lock:
            maybe = list(map(self._entries.get, keys))
            for e in maybe:
                if e is None or not e.host_ready or e.stale:
                    return None
            got = cast("list[Entry]", maybe)
            for e in got:
                e.pins += 1
                if count_hits:
                    e.hits += 1
            self._policy.remove_many(keys)
            return [e.host_slot for e in got]  # type: ignore[misc]

    # --- access ---
    def touch(self, keys: Iterable[bytes]) -> None:
        """Record a hit (raises the access count, refreshes recency)."""
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    e.hits += 1
                    self._policy.touch(key)
                elif self._cold.touch(key):  # recency in its sets; the count in the ghost map
                    self._core.remember_hits(key, self._ghost.get(key, 0) + 1)

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            get, refresh = self._core.get, self._core.refresh
            for key in keys:
                e = get(key)
                e.pins += 1
                refresh(key, e)

    def unpin(self, keys: Iterable[bytes], *, uncount_hits: bool = False) -> None:
        """`uncount_hits`: take back the hit `acquire(count_hits=True)` recorded (a load that
        let these blocks go unread; they are acquired, and counted, again later)."""
        with self._lock:
            entries, add, children = self._entries, self._policy.add, self._children
            for key in keys:
                e = entries.get(key)
                if e is None:
                    raise IndexStateError(f"unknown key {key.hex()}")
                if e.pins <= 0:
                    raise IndexStateError(f"unpin of unpinned key {key.hex()}")
                e.pins -= 1
                if uncount_hits and e.hits > 0:
                    e.hits -= 1
                if e.pins == 0 and e.host_ready and not (e.releasing or e.stale or e.evicting):
                    # The common case (a loaded host block): it only becomes evictable again
                    # (a pinned key is in no policy, so no membership test first).
                    if e.lower or key not in children:
                        add(key, e.hits)
                else:
                    self._core.settle(key, e)

    # --- host slots ---
    def grow_usable_slots(self, usable: int) -> int:
        """Slots below `usable` became usable (their memory is ready): free them. Never shrinks.
        Returns how many slots were added."""
        with self._lock:
            return self._slots.grow(usable)

    def allocate_slots(self, n: int) -> list[int]:
        """Up to `n` free slots (fewer when the pool is short; evict first to get more)."""
        with self._lock:
            return self._slots.take(n)

    def release_slots(self, slots: Iterable[int]) -> None:
        """Return slots from `allocate_slots` that were not used for a fill."""
        with self._lock:
            self._slots.give_back(slots)

    # --- host copy lifecycle: begin/commit_host_fill(s) in host_fills.py ---
    def begin_evict(self) -> Victim | None:
        """Choose the next evictable host copy per policy; it stops being readable from host."""
        with self._lock:
            key = self._policy.pop_victim()
            if key is None:
                return None
            assert isinstance(key, bytes)
            e = self._entries[key]
            assert e.evictable and e.host_slot is not None
            e.evicting = True
            return Victim(key, e.host_slot, e.hits, tiers_of(e.lower))

    def finish_evict(self, key: bytes) -> None:
        """The host copy is gone (spilled or dropped): its slot becomes free, or, while jobs
        still read it (pinned), when the last of them unpins."""
        with self._lock:
            e = self._entries.get(key)  # an evicting block is warm: never warm one to fail
            if e is None or not e.evicting or e.host_slot is None:
                raise IndexStateError(f"key {key.hex()} is not being evicted")
            e.host_ready, e.evicting, e.releasing = False, False, True
            self._core.unlink(e)  # no longer readable from host: its parent may be a tail now
            self._core.settle(key, e)

    # --- lower-tier copies ---
    def begin_write(self, key: bytes, tier: Tier) -> bool:
        """Mark a write to `tier` in flight; False (nothing to do) if a copy exists or is coming."""
        bit = TIER_BIT[tier]
        with self._lock:
            if key not in self._entries and self._cold.on(key, tier):
                return False  # already there: the cold block stays cold
            e = self._core.get(key)
            if (e.lower | e.pending) & bit or e.stale or self._core.orphan(e):
                return False
            if not self.room.make_room(
                tier, 1, keeps_host=e.host_slot is not None and not e.evicting
            ):
                return False
            e.pending |= bit
            self._warm_on[tier] += 1
            return True

    def begin_pass_through(
        self,
        keys: Sequence[bytes],
        tier: Tier,
        parents: Sequence[bytes | None] | None = None,
    ) -> int:
        """New keys a store streams through reused host slots straight to `tier` (no host copy
        is kept): each gets an entry with a pending write there, known but not readable until
        `commit_write`, room made for it on `tier` and its chain link counted. Stops at the
        first key `tier` has no room for (the later ones would be orphans); returns how many
        were started. Counts the store as an access, as `begin_host_fills` does."""
        bit = TIER_BIT[tier]
        with self._lock:
            core, make_room = self._core, self.room.make_room
            for n, key in enumerate(keys):
                e = self._entries.get(key)
                if e is None:
                    e = core.add(key)
                    if not e.lower:
                        parent = parents[n] if parents is not None else None
                        core.born(e, parent if parent != key else None)
                if e.host_slot is not None or e.stale or (e.lower | e.pending) & bit:
                    raise IndexStateError(f"key {key.hex()} is cached or being written")
                if not make_room(tier, 1):
                    core.settle(key, e)
                    return n
                e.hits += 1
                e.pending |= bit
                self._warm_on[tier] += 1
            return len(keys)

    def commit_write(self, key: bytes, tier: Tier, ok: bool) -> None:
        bit = TIER_BIT[tier]
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.pending & bit:
                raise IndexStateError(f"key {key.hex()} has no {tier.value} write in flight")
            e.pending &= ~bit
            if ok:
                e.lower |= bit
            else:
                self._warm_on[tier] -= 1
            self._core.settle(key, e)

    def set_present(self, keys: Iterable[bytes], tier: Tier, present: bool) -> Sequence[bytes]:
        """Record presence on `tier` learned from its store (restart scan: True; the store's
        eviction, a failed read: False). Returns the keys whose state changed, each once (those
        with an entry first). A restart adopts millions of blocks: blocks without an entry go
        to the cold sets in one batch, and no entry is made for them (joined keys, with no
        entry yet: straight from their buffer)."""
        if present and isinstance(keys, JoinedKeys) and keys and keys.width > HEAD_LEN:
            with self._lock:
                if not self._entries:
                    return self._cold.add_joined(keys, tier)
        bit = TIER_BIT[tier]
        keys = list(keys)
        changed: list[bytes] = []
        with self._lock:
            entries, core = self._entries, self._core
            # Blocks without an entry stay (or become) cold; short keys are never cold.
            if not entries and min(map(len, keys), default=HEAD_LEN + 1) > HEAD_LEN:
                warm, cold = [], keys  # a restart's adoption: no entry to look at
            else:
                warm = [k for k in keys if k in entries or len(k) <= HEAD_LEN]
                cold = [k for k in keys if k not in entries and len(k) > HEAD_LEN]
            for key in dict.fromkeys(warm):
                e = entries.get(key)
                if e is None:
                    if not present:
                        continue
                    e = core.add(key)
                before = e.lower | e.pending
                if present:
                    if not e.lower & bit and not e.stale:
                        e.lower |= bit
                        core.on_moved(before, e.lower | e.pending)
                        changed.append(key)
                        # A chain parent with a lower copy may leave host.
                        core.refresh(key, e)
                elif e.lower & bit:
                    e.lower &= ~bit
                    core.on_moved(before, e.lower | e.pending)
                    changed.append(key)
                    core.settle(key, e)
            if present and cold:  # none: no set turns live (a miss would ask it)
                changed += self._cold.add_on(cold, tier)
            else:
                for k in dict.fromkeys(cold):
                    gone, up = self._cold.discard_on(k, tier)
                    if gone:
                        changed.append(k)
                        if up is not None and not self._cold.has(k):
                            core.kid_dropped(up)  # left every tier
        return changed

    def reset(self) -> list[tuple[bytes, Entry]]:
        """Forget every key. Idle warm ones are removed now (returned, so their lower-tier copies
        can be deleted; cold ones: `take_forgotten`); ones in use turn stale (never readable)
        and are cleaned as their jobs end."""
        with self._lock:
            # Cold blocks are fingerprints: the worker deletes them by namespace, and the
            # cleared sets say which keys it reports were ours (`take_forgotten`).
            removed: list[tuple[bytes, Entry]] = []
            heads = self._core.heads
            self._cold.clear()
            self._children.clear()
            self._kids.clear()
            # Not the room's evictions: copies evicted by key whose deletes no job carried yet are
            # still on their tier; the next job deletes (and announces) them as usual.
            for key, e in list(self._entries.items()):
                e.stale, e.parent, e.up = True, None, None
                self._policy.remove(key)
                if (
                    e.pins == 0
                    and not e.evicting
                    and not e.pending
                    and not (e.host_slot is not None and not e.host_ready)
                ):
                    if e.host_slot is not None:
                        self._slots.give(e.host_slot)
                    del self._entries[key]
                    heads.remove(key)
                    removed.append((key, e))
            self._ghost.clear()
            left = [e.lower | e.pending for e in self._entries.values()]
            for tier, bit in TIER_BIT.items():  # what stale blocks still hold or write
                self._warm_on[tier] = sum(bool(m & bit) for m in left)
        return removed

    def take_garbage(self) -> dict[Tier, list[bytes]]:
        """Per lower tier, copies of stale keys that must be deleted (written after a reset)."""
        with self._lock:
            return self._core.take_garbage()
