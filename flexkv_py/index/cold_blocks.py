"""Cold blocks: lower-tier presence of blocks with no host copy, no pin and nothing in flight.

Most cached blocks are cold (a 4 TB SSD tier of 256 KiB blocks is ~16 M of them, the host tier a
few thousand), so they are not `Entry` objects (~120 B each in Python) but one `BlockSet` per
lower tier: 8-byte fingerprints (digests) of head + hash in a Rust table, ~22 B per block. A
block is warm (an `Entry` in the index, lower-tier bits in `Entry.lower`) or cold (here), never
both; the index moves a block between the two as it gains or loses a host copy, a pin or a
pending write.

Full keys. A digest cannot be turned back into a key, but two paths need the keys of cold blocks:
reset (the worker deletes every copy by key, and KV events carry block hashes) and the listing
for diagnostics. So each cold block's hash is also appended, once, to a per-head byte arena
(hash length bytes per block, no per-block object); records of blocks that left are dropped
lazily: `keys()` filters by the sets, and the arena is compacted when it holds 1.5x the live
blocks. Worst case ~22 + 48 B per cold block, about 54 B on average (66 B on the chain tier).

Capacity eviction is the index's (tier_index.py): it chooses the spill tier's victims here and
sends their deletes with the write that needs the room. Chains (`CHAIN_TIER`, the SSD): each
block in that set keeps its parent's digest and a count of cached children, so victims leave
tail-first (the set evicts only blocks no cached child depends on, rust/index/
block_set_chains.rs): 12 bytes more per block. A parent is named by `key_digest`: its 8-byte
digest (a clash, ~2^-64 per pair, could only change the eviction order). Evicted
digests are turned back into full keys (a DropJob needs them) by one scan of the arena in Rust
per batch of victims (`find_records`).

Not locked: the owning `TierIndex` calls it under its lock. Keys no longer than a head (tests'
short keys) are never cold: the index keeps them as entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexkv_py._native import BlockSet
from flexkv_py.index.entry import TIER_BIT
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.tier_names import LOWER_TIERS, Tier

_COMPACT_RATIO = 1.5
_COMPACT_MIN = 4096
# The tier whose set keeps chain links (the spill tier: the one with capacity eviction).
CHAIN_TIER = Tier.SSD
digest_of = BlockSet.digest
# key_digest(key): the 8-byte name chain parents are called by (`Entry.up`, `_kids`): the key's
# digest itself, so a chain link costs 12 bytes in the set.
key_digest = BlockSet.parent_name


class ColdBlocks:
    def __init__(self) -> None:
        self._sets: list[tuple[int, BlockSet]] = [
            (TIER_BIT[t], BlockSet(chains=t is CHAIN_TIER)) for t in LOWER_TIERS
        ]
        self._by_tier = {t: s for t, (_, s) in zip(LOWER_TIERS, self._sets, strict=True)}
        self._chain_bit = TIER_BIT[CHAIN_TIER]
        self._chains = self._by_tier[CHAIN_TIER]
        # Sets that ever held a block since the last clear: a lookup's miss asks only these
        # (usually the SSD tier's alone), not every tier.
        self._live: list[BlockSet] = []
        # (head, hash length) -> concatenated hashes of blocks that became cold (maybe left).
        self._arena: dict[tuple[bytes, int], bytearray] = {}
        self._records = 0

    # --- queries
    def mask(self, key: bytes) -> int:
        """TIER_BIT mask of the lower tiers holding `key` cold (0: not cold)."""
        m = 0
        if len(key) <= HEAD_LEN:
            return 0
        for bit, s in self._sets:
            if key in s:
                m |= bit
        return m

    def has(self, key: bytes) -> bool:
        return len(key) > HEAD_LEN and any(key in s for s in self._live)

    def on(self, key: bytes, tier: Tier) -> bool:
        return len(key) > HEAD_LEN and key in self._by_tier[tier]

    def run(self, head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """Index of the first of hashes[start:stop] that no tier holds cold (stop if none)."""
        i = start
        advanced = True
        while advanced and i < stop:
            advanced = False
            for s in self._live:
                r = s.prefix_run(head, hashes, i, stop)
                if r:
                    i += r
                    advanced = True
                    if i >= stop:
                        break
        return i

    def count(self, tier: Tier) -> int:
        return len(self._by_tier[tier])

    def set_bytes(self) -> int:
        """Heap bytes of the per-tier sets (Rust)."""
        return sum(s.nbytes() for _, s in self._sets)

    def arena_bytes(self) -> int:
        """Bytes of the key arena (Python bytearrays, over-allocation not counted)."""
        return sum(len(a) for a in self._arena.values())

    def _live_hashes(self, head: bytes, n: int, arena: bytearray) -> list[bytes]:
        """The arena's hashes whose blocks are still cold, each once (its latest record: the
        order blocks cooled), found with one present_mask per set, not a call per record."""
        hashes = [bytes(arena[off : off + n]) for off in range(0, len(arena), n)]
        masks = [s.present_mask(head, hashes, 0, len(hashes)) for s in self._live]
        present = masks[0] if len(masks) == 1 else bytes(map(any, zip(*masks, strict=True)))
        kept = [h for h, p in zip(hashes, present, strict=True) if p] if masks else []
        return list(reversed(dict.fromkeys(reversed(kept))))

    def keys(self) -> list[bytes]:
        """Every cold key (each once), in the order the blocks became cold."""
        return [
            head + h
            for (head, n), arena in self._arena.items()
            for h in self._live_hashes(head, n, arena)
        ]

    # --- changes
    def add(self, key: bytes, mask: int, up: bytes | None = None, kids: int = 0) -> bool:
        """Make `key` cold on the tiers in `mask` (it was warm: in no set). `up` (its parent's
        digest) and `kids` (cached children counted against it) go with it into the chain
        tier's set; False if `mask` has no chain tier (the caller keeps the counts)."""
        for bit, s in self._sets:
            if mask & bit:
                if s is self._chains:
                    s.add_chained(key, up, kids)
                else:
                    s.add_key(key)
                self._mark_live(s)
        self._record(key)
        self._maybe_compact()
        return bool(mask & self._chain_bit)

    def touch(self, key: bytes) -> bool:
        """A use of a cold block (e.g. a GPU prefix hit): the most recent in its sets. False if
        it is not cold."""
        if len(key) <= HEAD_LEN:
            return False
        head, hashes, hit = key[:HEAD_LEN], [key[HEAD_LEN:]], False
        for s in self._live:
            if key in s:
                s.touch(head, hashes)
                hit = True
        return hit

    # --- chains (the chain tier's set)
    def add_kid(self, up: bytes) -> bool:
        """Count a cached child against the cold block named `up`; False: not cold."""
        return self._chains.add_kid(up)

    def drop_kid(self, up: bytes) -> bool:
        return self._chains.drop_kid(up)

    def has_digest(self, up: bytes) -> bool:
        """Is the block named `up` (`key_digest`) cold on the chain tier?"""
        return self._chains.has_digest(up)

    def kids_of(self, key: bytes) -> int | None:
        return self._chains.kids_of(key) if len(key) > HEAD_LEN else None

    def link(self, children: list[bytes], parents: list[bytes]) -> int:
        """Chain links between cold blocks of the chain tier (a restart's adoption)."""
        return self._chains.link_keys(children, parents)

    def evict(self, n: int) -> tuple[list[bytes], list[bytes]]:
        """Evict up to `n` chain tails from the chain tier's set, least recently used first
        (a parent whose last cold child went is a tail at once). Returns the evicted keys and
        the parent names of theirs that are not in the set (warm: the caller's counts).
        Blocks also cold on another tier stay there."""
        popped = self._chains.pop_tails(n)
        if not popped:
            return [], []
        digests = [d for d, _ in popped]
        ups = [u for _, u in popped if u is not None]
        keys: list[bytes] = []
        for (head, hlen), arena in self._arena.items():
            found = BlockSet.find_records(head, bytes(arena), hlen, digests)
            keys.extend(head + bytes(arena[i * hlen : (i + 1) * hlen]) for i in found)
        keys = list(dict.fromkeys(keys))
        self._maybe_compact()
        return keys, ups

    def add_on(self, keys: list[bytes], tier: Tier) -> list[bytes]:
        """Mark keys cold on `tier` (none of them warm, all longer than a head); returns those
        newly on it. Batched per head (a restart adopts millions): a few calls into the sets
        per head, not per key."""
        s = self._by_tier[tier]
        self._mark_live(s)
        others = [o for o in self._live if o is not s]
        if not others and not len(s):
            return self._add_to_empty(s, keys)
        groups: dict[bytes, list[bytes]] = {}
        for key in dict.fromkeys(keys):
            head = key[:HEAD_LEN]
            group = groups.get(head)
            if group is None:
                group = groups[head] = []
            group.append(key)
        changed: list[bytes] = []
        for head, group in groups.items():
            hashes = [k[HEAD_LEN:] for k in group]
            n = len(hashes)
            before = s.present_mask(head, hashes, 0, n)
            elsewhere = bytearray(n)
            for o in others:
                elsewhere = bytearray(
                    a | b
                    for a, b in zip(elsewhere, o.present_mask(head, hashes, 0, n), strict=True)
                )
            s.add_keys(group)
            new = [i for i, was in enumerate(before) if not was]
            changed.extend(group[i] for i in new)
            self._record_hashes(head, [hashes[i] for i in new if not elsewhere[i]])
        self._maybe_compact()
        return changed

    def _add_to_empty(self, s: BlockSet, keys: list[bytes]) -> list[bytes]:
        """`add_on` when no set holds a block (a restart's adoption): every distinct key is new,
        so one batch call adds them and their hashes go to the arena in one join per head."""
        s.reserve(len(keys))  # one allocation, no regrowth while millions go in
        if s.add_keys(keys) != len(keys):
            keys = list(dict.fromkeys(keys))  # duplicates given (all new all the same)
        if not keys:
            return keys
        head = keys[0][:HEAD_LEN]
        stride = len(keys[0])
        n, count = stride - HEAD_LEN, len(keys)
        blob = b"".join(keys)
        # One head, one hash length (the usual restart): checked and split by strided slices
        # of the joined keys, a few C-level passes instead of a Python step per key.
        if len(blob) == stride * count and all(
            blob[j::stride] == head[j : j + 1] * count for j in range(HEAD_LEN)
        ):
            hashes = bytearray(n * count)
            for j in range(n):
                hashes[j::n] = blob[HEAD_LEN + j :: stride]
            arena = self._arena.get((head, n))
            if arena is None:
                arena = self._arena[(head, n)] = bytearray()
            arena += hashes
            self._records += count
        else:
            for key in keys:
                self._record(key)
        return keys

    def discard_on(self, key: bytes, tier: Tier) -> tuple[bool, bytes | None]:
        """Remove `key` from `tier`'s set: (was it there, its parent's name if known)."""
        if len(key) <= HEAD_LEN:
            return False, None
        s = self._by_tier[tier]
        if s is self._chains:
            got = s.take_chained(key)
            gone, up = got is not None, None if got is None else got[0]
        else:
            gone, up = s.discard_key(key), None
        if gone:
            self._maybe_compact()
        return gone, up

    def take(self, key: bytes) -> tuple[int, bytes | None, int]:
        """Remove `key` from every set (it becomes warm): (the mask it had, its parent's
        name, the cached children counted against it)."""
        m, up, kids = 0, None, 0
        if len(key) <= HEAD_LEN:
            return 0, None, 0
        for bit, s in self._sets:
            if s is self._chains:
                got = s.take_chained(key)
                if got is not None:
                    m |= bit
                    up, kids = got
            elif s.discard_key(key):
                m |= bit
        return m, up, kids

    @property
    def live(self) -> list[BlockSet]:
        """The sets that may hold blocks (the same list object for the index's lifetime)."""
        return self._live

    def clear(self) -> None:
        self._live.clear()
        for _, s in self._sets:
            s.clear()
        self._arena.clear()
        self._records = 0

    def _mark_live(self, s: BlockSet) -> None:
        if s not in self._live:
            self._live.append(s)

    def _record(self, key: bytes) -> None:
        head, h = key[:HEAD_LEN], key[HEAD_LEN:]
        arena = self._arena.get((head, len(h)))
        if arena is None:
            arena = self._arena[(head, len(h))] = bytearray()
        arena += h
        self._records += 1

    def _record_hashes(self, head: bytes, hashes: list[bytes]) -> None:
        by_len: dict[int, list[bytes]] = {}
        for h in hashes:
            by_len.setdefault(len(h), []).append(h)
        for n, same in by_len.items():
            arena = self._arena.get((head, n))
            if arena is None:
                arena = self._arena[(head, n)] = bytearray()
            arena += b"".join(same)
            self._records += len(same)

    def _maybe_compact(self) -> None:
        if self._records <= _COMPACT_MIN:
            return
        live = sum(len(s) for _, s in self._sets)
        if self._records <= _COMPACT_RATIO * live:
            return
        self._records = 0
        for group, arena in list(self._arena.items()):
            still = self._live_hashes(group[0], group[1], arena)
            if still:
                self._arena[group] = bytearray(b"".join(still))
                self._records += len(still)
            else:
                del self._arena[group]
