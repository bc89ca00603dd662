"""Host fills begun and committed in batches: a store's blocks enter the tier index here.

A store of n new blocks is n entries, but not n calls of the general path: keys never cached
(the common case: no entry, in no cold set) get their entry, head-map slot, chain count and
link in one loop with no helper call per key (`_new_fills`), ~1 µs per block where the general
path (index_core.py `add` + `born` + `link`, a Rust cold-set call per tier and key) took ~5
(benches/RESULTS.md 22.perf). Whether a key is cold is asked once per set for the batch
(`_cold_among`). Keys that are cold (warming) or known go the general way; the result is the
same state either way (tests/unit/index/test_host_fills.py compares the two on random batches).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import fields
from itertools import repeat
from typing import NamedTuple

from flexkv_py.index.cold_blocks import key_digest
from flexkv_py.index.entry import Entry, IndexStateError
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.index_core import IndexCore

# A new fill's entry is built positionally (a store makes one per block; keywords cost ~50 %
# more): the order below must be Entry's, checked once at import.
_FIELDS = ("host_slot", "host_ready", "evicting", "releasing", "lower", "pending", "pins", "hits")
_CHAIN_FIELDS = (*_FIELDS, "stale", "parent", "up")
# Entry's fields changed (a merge): keyword construction and no chain step, slower but right
# (tests/unit/index/test_host_fills.py asserts the fast form is in use).
POSITIONAL = tuple(f.name for f in fields(Entry)) == _CHAIN_FIELDS


class FillBatch(NamedTuple):
    """One `begin_host_fills` call: its keys, slots, chain parents, per-key cold flags (None:
    none is cold) and whether the store counts as an access."""

    keys: Sequence[bytes]
    slots: Sequence[int]
    parents: Sequence[bytes | None]
    cold: bytes | None
    count_access: bool


def _filling_entry(slot: int, hits: int) -> Entry:
    """The entry of a block never cached whose host fill begins: pinned once, not ready."""
    if POSITIONAL:
        return Entry(slot, False, False, False, 0, 0, 1, hits)
    return Entry(host_slot=slot, pins=1, hits=hits)


class HostFills:
    """Host fills begun and committed, one key or a store's batch, on the index's core under
    the index's lock."""

    def __init__(self, lock: threading.Lock, core: IndexCore) -> None:
        # The core's containers, bound once (they live as long as the index): a batch's loop
        # reads them with no hop through the core.
        self._lock = lock
        self._core = core
        self._entries = core.entries
        self._by_head = core.by_head
        self._children = core.children
        self._kids = core.kids
        self._cold = core.cold
        self._cold_live = core.cold_live
        self._ghost = core.ghost
        self._policy = core.policy
        self._slots = core.slots
        self._keep_chains = core.keep_chains

    def begin_host_fill(
        self, key: bytes, slot: int, *, count_access: bool = True, parent: bytes | None = None
    ) -> None:
        """A job starts writing the key's page into `slot` (from allocate_slots); pins the key.
        `parent`: the block before it in its chain (kept cached while this one is)."""
        self.begin_host_fills((key,), (slot,), count_access=count_access, parents=(parent,))

    def begin_host_fills(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        count_access: bool = True,
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        """`begin_host_fill` for many keys under one lock (a store's blocks); `parents[i]`:
        key i's chain parent or None (default: no links)."""
        if parents is None:
            parents = (None,) * len(keys)
        elif len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        with self._lock:
            self._new_fills(FillBatch(keys, slots, parents, self._cold_among(keys), count_access))

    def _begin_fill(self, key: bytes, slot: int, parent: bytes | None, count_access: bool) -> None:
        """The general path of one key (lock held): a cold block warming, or a known key."""
        e = self._entries.get(key)
        if e is None:
            e = self._core.add(key)
            if not e.lower:  # not a cold block warming: cached for the first time
                self._core.born(e, parent if parent != key else None)
        elif e.host_slot is not None or e.stale:
            raise IndexStateError(f"key {key.hex()} has a host copy or is stale")
        e.host_slot = slot
        e.host_ready = False
        if count_access:
            e.hits += 1
        e.pins += 1
        self._policy.remove(key)  # pinned: not evictable (what _refresh does here)
        if parent is not None and parent != key and self._keep_chains:
            self._core.link(e, parent)

    def _cold_among(self, keys: Sequence[bytes]) -> bytes | None:
        """Per key, nonzero if some lower tier holds it cold; None when none can (no cold
        block anywhere). One call per set for a batch of one head (a store's keys)."""
        live = self._cold_live
        if not live or not keys:
            return None
        head = keys[0][:HEAD_LEN]
        if len(head) < HEAD_LEN or any(k[:HEAD_LEN] != head for k in keys):
            has = self._cold.has
            return bytes(has(k) for k in keys)
        hashes = [k[HEAD_LEN:] for k in keys]
        masks = [s.present_mask(head, hashes, 0, len(hashes)) for s in live]
        if len(masks) == 1:
            return masks[0]
        return bytes(map(any, zip(*masks, strict=True)))

    def _new_fills(self, batch: FillBatch) -> None:
        """Begin the fills (lock held). A key never cached gets its entry in one step: what
        index_core.py `add` + `born` + `link` do for a block with no lower-tier copy, no kids
        and no place in the policy (it had no entry), inlined; the others go through `_begin_fill`.
        All checks come first, so a bad batch changes nothing."""
        if self._new_chain(batch):
            return
        keys, slots, parents, cold, count_access = batch
        entries = self._entries
        for key in keys:
            e = entries.get(key)
            if e is not None and (e.host_slot is not None or e.stale):
                raise IndexStateError(f"key {key.hex()} has a host copy or is stale")
        if len(set(keys)) != len(keys):
            raise IndexStateError("a key appears twice in one batch of host fills")
        by_head, ghost = self._by_head, self._ghost
        children, kids, policy_remove = self._children, self._kids, self._policy.remove
        link, cold_has, bump = self._keep_chains, self._cold.has, int(count_access)
        kid_added = self._core.kid_added
        head, sub = b"", None
        born = None  # the key made just before: a chain parent known to be warm, in no policy
        for i, (key, slot, parent) in enumerate(zip(keys, slots, parents, strict=True)):
            if key in entries or (cold is not None and cold[i]):
                self._begin_fill(key, slot, parent, count_access)
                born = None
                continue
            e = _filling_entry(slot, (ghost.pop(key, 0) if ghost else 0) + bump)
            entries[key] = e
            if len(key) > HEAD_LEN:  # HeadMap.add, the head's map kept across the batch
                if key[:HEAD_LEN] != head:
                    head = key[:HEAD_LEN]
                    sub = by_head.get(head)
                    if sub is None:
                        sub = by_head[head] = {}
                assert sub is not None
                sub[key[HEAD_LEN:]] = e
            if parent is not None and parent != key:
                if parent is born or parent in entries:  # warm: its kid count is ours
                    up = e.up = key_digest(parent)
                    kids[up] = kids.get(up, 0) + 1
                elif cold_has(parent):
                    e.up = key_digest(parent)
                    kid_added(e.up)
                if link:
                    e.parent = parent
                    children[parent] = children.get(parent, 0) + 1
                    if parent is not born:  # a key made here is in no policy yet
                        pe = entries.get(parent)
                        if pe is None or not pe.lower:
                            policy_remove(parent)
            born = key

    def _new_chain(self, batch: FillBatch) -> bool:
        """A store's usual batch, whole, without a Python step per key: a chain (key i's parent
        is key i-1) of distinct keys of one head, none cached or cold, whose own names are in
        no count. Their entries are made by one `map` and filed by `dict.update`s; only the
        first key's parent (outside the batch) is linked one by one. False (nothing changed)
        for any other batch."""
        keys, slots, parents, cold, count_access = batch
        n = len(keys)
        if not POSITIONAL:
            return False
        entries, children, kids = self._entries, self._children, self._kids
        if n < 2 or (cold is not None and any(cold)) or not entries.keys().isdisjoint(keys):
            return False
        keys = list(keys)
        inner = keys[:-1]
        first = parents[0]
        if list(parents[1:]) != inner or first in keys or len(set(keys)) != n:
            return False
        head = keys[0][:HEAD_LEN]
        if min(map(len, keys)) <= HEAD_LEN or any(k[:HEAD_LEN] != head for k in keys):
            return False
        ups = list(map(key_digest, inner))  # keys[1:]'s parents' names
        if len(set(ups)) != len(ups) or not kids.keys().isdisjoint(ups):
            return False
        link = self._keep_chains
        if link and not children.keys().isdisjoint(inner):
            return False
        bump, ghost = int(count_access), self._ghost
        hits = [h + bump for h in map(ghost.pop, keys, repeat(0))] if ghost else repeat(bump)
        first_up = None
        if first is not None and (first in entries or self._cold.has(first)):
            first_up = key_digest(first)
        new = list(
            map(
                Entry,
                slots,
                repeat(False),
                repeat(False),
                repeat(False),
                repeat(0),
                repeat(0),
                repeat(1),
                hits,
                repeat(False),
                [first, *inner] if link else repeat(None),
                [first_up, *ups],
            )
        )
        entries.update(zip(keys, new, strict=True))
        sub = self._by_head.get(head)
        if sub is None:
            sub = self._by_head[head] = {}
        sub.update(zip((k[HEAD_LEN:] for k in keys), new, strict=True))
        kids.update(zip(ups, repeat(1)))
        if first_up is not None:  # what `born` does for the first key
            if first in entries:
                kids[first_up] = kids.get(first_up, 0) + 1
            else:
                self._core.kid_added(first_up)
        if link:
            children.update(zip(inner, repeat(1)))
            if first is not None:  # what `link` does for the first key
                children[first] = children.get(first, 0) + 1
                pe = entries.get(first)
                if pe is None or not pe.lower:
                    self._policy.remove(first)
        return True

    def commit_host_fill(self, key: bytes, ok: bool) -> bool:
        """End a fill and unpin; a failed fill frees its slot. True if the copy is readable."""
        return bool(self.commit_host_fills((key,), (ok,)))

    def commit_host_fills(self, keys: Sequence[bytes], oks: Sequence[bool]) -> list[bytes]:
        """`commit_host_fill` for many keys under one lock (a store's blocks). Returns the keys
        whose host copy is readable now (not those that failed or were reset meanwhile)."""
        readable: list[bytes] = []
        with self._lock:
            entries, add, children = self._entries, self._policy.add, self._children
            settle, unlink = self._core.settle, self._core.unlink
            for key, ok in zip(keys, oks, strict=True):
                e = entries.get(key)
                # A releasing slot (evicted while pinned) is not a fill: committing it would
                # make the index promise host bytes that are being given up.
                if e is None or e.host_slot is None or e.host_ready or e.releasing:
                    raise IndexStateError(f"key {key.hex()} has no host fill in flight")
                e.pins -= 1
                if ok:
                    e.host_ready = True
                    if not e.stale:
                        readable.append(key)
                    if e.pins == 0 and not (e.stale or e.evicting):
                        # The common case (a stored block): it becomes evictable, nothing else
                        # (a pinned key is in no policy, so no membership test first).
                        if e.lower or key not in children:
                            add(key, e.hits)
                        continue
                else:
                    self._slots.give(e.host_slot)
                    e.host_slot = None
                    unlink(e)
                settle(key, e)
        return readable
