"""Cold blocks: lower-tier presence of blocks with no host copy, no pin and nothing in flight.

Most cached blocks are cold (a 4 TB SSD tier of 256 KiB blocks is ~16 M of them, the host tier a
few thousand), so they are not `Entry` objects (~120 B each in Python) but one `BlockSet` per
lower tier: 8-byte fingerprints (digests) of head + hash in a Rust table, ~22 B per block. A
block is warm (an `Entry` in the index, lower-tier bits in `Entry.lower`) or cold (here), never
both; the index moves a block between the two as it gains or loses a host copy, a pin or a
pending write.

No full keys. A digest cannot be turned back into a key, and nothing here needs one: the
worker's store resolves a fingerprint to its own keys (its key table is hashed by the same 8
bytes, rust/index/by_fingerprint.rs). So an eviction hands out fingerprints (`take_evicted`,
sent in the next job's `Drops`), the worker deletes the keys they name and returns them, and
the manager announces those (`removed` KV events, one job later than the decision). A reset
deletes the namespace on the worker; the sets it cleared are kept (`take_forgotten`) until
that delete reports its keys, so exactly the blocks the index held are announced. A clash
(~2^-64 per pair) can drop one block too many on the worker: a lost copy, recomputed when a
load finds it missing, never wrong KV. Keys of cold blocks cannot be listed (`keys_among`
answers for given candidates).

Capacity eviction is the index's (tier_index.py): it chooses the spill tier's victims here and
sends their deletes with the write that needs the room. Chains (`CHAIN_TIER`, the SSD): each
block in that set keeps its parent's digest and a count of cached children, so victims leave
tail-first (the set evicts only blocks no cached child depends on, rust/index/
block_set_chains.rs): 7 bytes more per block. A parent is named by `key_digest`: 8 bytes, its
digest's first 5 then zeros (a clash, ~2^-40 per pair, can only change the eviction order).
A name is not a fingerprint: drops and resets go by `key_print`, the full 8-byte digest.

Not locked: the owning `TierIndex` calls it under its lock. Keys no longer than a head (tests'
short keys) are never cold: the index keeps them as entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from flexkv_py._native import BlockSet
from flexkv_py.index.entry import TIER_BIT
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.tier_names import LOWER_TIERS, Tier

# The tier whose set keeps chain links (the spill tier: the one with capacity eviction).
CHAIN_TIER = Tier.SSD
DIGEST_LEN = 8
digest_of = BlockSet.digest
# key_digest(key): the 8-byte name chain parents are called by (`Entry.up`, `_kids`): the key's
# digest cut to 5 bytes and zero-padded, so a chain link (name + u16 count) costs 7 bytes.
key_digest = BlockSet.parent_name


def key_print(key: bytes) -> bytes:
    """The key's 8-byte fingerprint: what evictions hand out and the worker resolves."""
    return digest_of(key, b"")


@dataclass
class Forgotten:
    """What a reset cleared: the sets of the blocks that were cold, and the fingerprints of
    evictions not yet sent. It answers which of the keys the worker's namespace delete
    reports the index held (those are announced), then it is dropped."""

    sets: dict[Tier, BlockSet] = field(default_factory=dict)
    evicted: frozenset[bytes] = frozenset()

    def held(self, key: bytes, tier: Tier) -> bool:
        s = self.sets.get(tier)
        return (s is not None and key in s) or (
            tier is CHAIN_TIER and bool(self.evicted) and key_print(key) in self.evicted
        )

    def __bool__(self) -> bool:
        return bool(self.evicted) or any(len(s) for s in self.sets.values())


class ColdBlocks:
    def __init__(self) -> None:
        # Sets that ever held a block since the last clear: a lookup's miss asks only these
        # (usually the SSD tier's alone), not every tier.
        self._live: list[BlockSet] = []
        self._new_sets()
        # Joined fingerprints of chain-tier blocks evicted and not yet handed out.
        self._evicted = bytearray()
        self._forgotten: list[Forgotten] = []

    def _new_sets(self) -> None:
        self._sets: list[tuple[int, BlockSet]] = [
            (TIER_BIT[t], BlockSet(chains=t is CHAIN_TIER)) for t in LOWER_TIERS
        ]
        self._by_tier = {t: s for t, (_, s) in zip(LOWER_TIERS, self._sets, strict=True)}
        self._chain_bit = TIER_BIT[CHAIN_TIER]
        self._chains = self._by_tier[CHAIN_TIER]

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

    def keys_among(self, candidates: Iterable[bytes]) -> list[bytes]:
        """The candidates that are cold (each once, in the order given): cold keys cannot be
        listed, only recognised."""
        return [k for k in dict.fromkeys(candidates) if self.has(k)]

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
        """Bytes of full keys kept for cold blocks: none (the worker resolves fingerprints)."""
        return 0

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

    def link_joined(self, children: JoinedKeys, parents: JoinedKeys) -> int:
        """`link` from joined buffers (a restart's report): no object per link."""
        if not children:
            return 0
        return self._chains.link_joined(children.joined, parents.joined, children.width)

    def evict(self, n: int) -> tuple[int, list[bytes]]:
        """Evict up to `n` chain tails from the chain tier's set, least recently used first
        (a parent whose last cold child went is a tail at once). Their fingerprints wait for
        `take_evicted`. Returns how many were evicted and the parent names of theirs that no
        block in the set counted (warm: the caller's counts). Blocks also cold on another tier
        stay there."""
        popped = self._chains.pop_tails(n)
        for d, _ in popped:
            self._evicted += d
        return len(popped), [u for _, u in popped if u is not None]

    def take_evicted(self) -> bytes:
        """The joined 8-byte fingerprints of the chain tier's evictions since the last call."""
        out, self._evicted = bytes(self._evicted), bytearray()
        return out

    def add_on(self, keys: list[bytes], tier: Tier) -> list[bytes]:
        """Mark keys cold on `tier` (none of them warm, all longer than a head); returns those
        newly on it. Batched per head (a restart adopts millions): a few calls into the sets
        per head, not per key."""
        s = self._by_tier[tier]
        self._mark_live(s)
        if not len(s):
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
            before = s.present_mask(head, hashes, 0, len(hashes))
            s.add_keys(group)
            changed.extend(k for k, was in zip(group, before, strict=True) if not was)
        return changed

    def add_joined(self, keys: JoinedKeys, tier: Tier) -> Sequence[bytes]:
        """`add_on` of joined keys (a restart's listing): into an empty set in one call from
        the buffer, no object per key; returns those newly on `tier` (all of them then)."""
        s = self._by_tier[tier]
        if len(s):
            return self.add_on(list(keys), tier)
        self._mark_live(s)
        if s.add_joined(keys.joined, keys.width) != len(keys):
            return list(dict.fromkeys(keys))  # duplicates given (all new all the same)
        return keys

    def _add_to_empty(self, s: BlockSet, keys: list[bytes]) -> list[bytes]:
        """`add_on` to an empty set (a restart's adoption): every distinct key is new, so one
        batch call adds them."""
        s.reserve(len(keys))  # one allocation, no regrowth while millions go in
        if s.add_keys(keys) != len(keys):
            keys = list(dict.fromkeys(keys))  # duplicates given (all new all the same)
        return keys

    def discard_on(self, key: bytes, tier: Tier) -> tuple[bool, bytes | None]:
        """Remove `key` from `tier`'s set: (was it there, its parent's name if known)."""
        if len(key) <= HEAD_LEN:
            return False, None
        s = self._by_tier[tier]
        if s is self._chains:
            got = s.take_chained(key)
            return got is not None, None if got is None else got[0]
        return s.discard_key(key), None

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
        """Forget every cold block (a reset). The cleared sets and unsent evictions are kept
        for `take_forgotten`: the worker deletes by namespace and reports keys, and these say
        which of them the index held."""
        gone = Forgotten(
            {t: s for t, s in self._by_tier.items() if len(s)},
            frozenset(self._split(self.take_evicted())),
        )
        if gone:
            self._forgotten.append(gone)
        self._live.clear()
        self._new_sets()

    def take_forgotten(self) -> list[Forgotten]:
        """What the resets since the last call cleared (see `clear`)."""
        out, self._forgotten = self._forgotten, []
        return out

    @staticmethod
    def _split(joined: bytes) -> list[bytes]:
        return [joined[i : i + DIGEST_LEN] for i in range(0, len(joined), DIGEST_LEN)]

    def _mark_live(self, s: BlockSet) -> None:
        if s not in self._live:
            self._live.append(s)
