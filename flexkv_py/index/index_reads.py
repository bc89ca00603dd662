"""The tier index's read side: every query that changes nothing.

The state it reads is the index's core (index_core.py); `TierIndex` (tier_index.py) owns both
and adds the transitions; the state, its rules and why the index is the source of truth are
described there. Every method takes the index's one lock.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Sequence

from flexkv_py.index.cold_blocks import key_digest
from flexkv_py.index.entry import TIER_BIT, Entry, fastest_of
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.index_core import IndexCore
from flexkv_py.index.tier_names import LOWER_TIERS, Tier


class IndexReads:
    """Every query of the index: reads of its core's state (entries, per-head map, cold blocks,
    slots, policy, ghost counts) under the index's lock, changing nothing."""

    def __init__(self, lock: threading.Lock, core: IndexCore) -> None:
        # The core's containers, bound once (they live as long as the index): a lookup reads
        # them with no hop through the core.
        self._lock = lock
        self._entries = core.entries
        self._by_head = core.by_head
        self._cold = core.cold
        self._cold_live = core.cold_live
        self._policy = core.policy
        self._slots = core.slots
        self._ghost = core.ghost
        self._kids = core.kids

    # --- queries ---
    def match(self, keys: Sequence[bytes]) -> list[Tier]:
        """Tier to read each key from, for the longest readable prefix starting at block 0."""
        out: list[Tier] = []
        with self._lock:
            get, cold = self._entries.get, self._cold
            for key in keys:
                e = get(key)
                tier = e.best_tier() if e is not None else fastest_of(cold.mask(key))
                if tier is None:
                    break
                out.append(tier)
        return out

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are readable (the length of `match`, without building it)."""
        return self.readable_prefix(keys)

    def readable_prefix(
        self, keys: Sequence[bytes], start: int = 0, stop: int | None = None
    ) -> int:
        """Index of the first key in keys[start:stop] that is not readable (stop if all are).

        The scheduler's hot path (every scheduling attempt of a waiting request, up to 8K+
        blocks): `Entry.readable` inlined, no tier list, no per-key call — the same rule as
        `match` (tests compare the two on random states)."""
        n = len(keys)
        stop = n if stop is None else min(stop, n)
        if start >= stop:
            return start  # an empty range: no hit
        # Slicing copies pointers only; iterating a slice beats indexing keys[i] per key.
        span = keys if start == 0 and stop == n else keys[start:stop]
        i = start
        with self._lock:
            get, has = self._entries.get, self._cold.has
            while True:
                # map() calls dict.get from C: ~25 % faster than a bound get(key) per key.
                for e in map(get, span):
                    if e is None or e.stale or not (e.host_ready or e.lower):
                        break
                    i += 1
                # Stopped at the end, at an unreadable entry, or at a key with no entry: only
                # the last may be a run of cold blocks.
                j = i
                while j < stop and keys[j] not in self._entries and has(keys[j]):
                    j += 1
                if j == i or j == stop:
                    return j
                i, span = j, keys[j:stop]

    def readable_hashes(
        self, head: bytes, hashes: Sequence[bytes], start: int = 0, stop: int | None = None
    ) -> int:
        """`readable_prefix` of the keys head + hashes[i], without building them: the
        scheduler's lookup of a request's block hashes (head: namespace prefix + variant)."""
        if len(head) != HEAD_LEN:
            raise ValueError(f"key head must be {HEAD_LEN} bytes, got {len(head)}")
        n = len(hashes)
        stop = n if stop is None else min(stop, n)
        if start >= stop:
            return start
        span = hashes if start == 0 and stop == n else hashes[start:stop]
        i = start
        with self._lock:
            sub = self._by_head.get(head)
            live = self._cold_live
            if sub is None:
                if not live:
                    return start
                sub = {}
            get, cold = sub.get, self._cold
            while True:
                for e in map(get, span):
                    if e is None or e.stale or not (e.host_ready or e.lower):
                        break
                    i += 1
                # The end, no cold block anywhere, or an unreadable entry.
                if i == stop or not live or hashes[i] in sub:
                    return i
                j = cold.run(head, hashes, i, stop)  # blocks with no entry: cold ones?
                if j == i or j == stop:
                    return j
                i, span = j, hashes[j:stop]

    def known(self, key: bytes) -> bool:
        """True if the key has any copy, readable or in flight (storing it again is redundant)."""
        with self._lock:
            return key in self._entries or self._cold.has(key)

    def known_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`known` of each key under one lock (a store's planning asks it of every block)."""
        with self._lock:
            entries = self._entries
            if not self._cold.live:  # no cold block anywhere (no lower tier holds one yet)
                return [key in entries for key in keys]
            has = self._cold.has
            return [key in entries or has(key) for key in keys]

    def entry(self, key: bytes) -> Entry | None:
        """A copy of the key's entry (for tests and diagnostics)."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                return copy.copy(e)
            mask = self._cold.mask(key)
            return Entry(lower=mask, hits=self._ghost.get(key, 0)) if mask else None

    def host_slot_of(self, key: bytes) -> int | None:
        """The slot of the key's readable host copy that is not leaving (None if none is)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.host_ready or e.stale or e.evicting:
                return None
            return e.host_slot

    def hits(self, key: bytes) -> int:
        with self._lock:
            e = self._entries.get(key)
            return e.hits if e is not None else self._ghost.get(key, 0)

    def keys(self) -> list[bytes]:
        """Every warm key (slow: for tests and diagnostics). Cold blocks are fingerprints, not
        listable: `cold_keys_among` recognises them."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self.keys())

    def loadable(self, keys: Sequence[bytes], n: int) -> int:
        """How many of the first `n` (readable) keys one load can take now: the host blocks it
        pins leave the evictable ones, and its lower-tier blocks stream through the staging
        slots it gets, free or evicted (coordinator/loads.py), so they need one between them.
        `n` when room is plenty (the usual case, O(1))."""
        with self._lock:
            room = len(self._slots.free) + len(self._policy)
            if n <= room:
                return n
            entries, policy = self._entries, self._policy
            staged = False
            for i, key in enumerate(keys[:n]):
                e = entries.get(key)
                if e is not None and e.host_ready and not e.evicting:
                    if key not in policy:
                        continue  # pinned already: its own slot, none taken
                    room -= 1  # pinned out of the evictable ones
                elif not staged:
                    staged = True
                    room -= 1  # the staging slot every lower-tier block of the load shares
                if room < 0:
                    return i
            return n

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._slots.free)

    def counts(self) -> dict[str, int]:
        with self._lock:
            es = self._entries.values()
            out = {
                "keys": len(self._entries),  # warm: entries (cold blocks: cold_*)
                "host_ready": sum(e.host_ready for e in es),
                "host_filling": sum(e.host_slot is not None and not e.host_ready for e in es),
                "evicting": sum(e.evicting for e in es),
                "releasing": sum(e.releasing for e in es),
            }
            for tier in LOWER_TIERS:
                bit = TIER_BIT[tier]
                cold = self._cold.count(tier)
                out[f"on_{tier.value}"] = sum(bool(e.lower & bit) for e in es) + cold
                out[f"cold_{tier.value}"] = cold
                out[f"{tier.value}_pending"] = sum(bool(e.pending & bit) for e in es)
            out.update(
                pinned=sum(e.pins > 0 for e in es),
                stale=sum(e.stale for e in es),
                evictable=len(self._policy),
                free_slots=len(self._slots.free),
                cold_set_bytes=self._cold.set_bytes(),
                cold_arena_bytes=self._cold.arena_bytes(),
            )
            return out

    def readable_on(self, key: bytes, tier: Tier) -> bool:
        """Does the index hold a readable copy of `key` on `tier` (not dropped, not reset)?"""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return self._cold.on(key, tier)
            return bool(e.lower & TIER_BIT[tier]) and not e.stale

    def lacking_on(self, keys: Iterable[bytes], tier: Tier) -> list[bytes]:
        """The keys with no readable copy on `tier` (`readable_on` false), under one lock: a
        store's blocks the write-behind still owes that tier."""
        bit = TIER_BIT[tier]
        with self._lock:
            get, on = self._entries.get, self._cold.on
            out = []
            for key in keys:
                e = get(key)
                if not (on(key, tier) if e is None else e.lower & bit and not e.stale):
                    out.append(key)
            return out

    def kids(self, key: bytes) -> int:
        """Cached children counted against `key` (its chain's descendants keep it)."""
        with self._lock:
            k = self._cold.kids_of(key) if key not in self._entries else None
            return k if k is not None else self._kids.get(key_digest(key), 0)

    @property
    def usable_host_slots(self) -> int:
        with self._lock:
            return self._slots.usable
