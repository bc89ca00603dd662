"""Host fills begun and committed in batches: a store's blocks enter the tier index here.

A store of n new blocks is n entries, but not n calls of the general path: keys never cached
(the common case: no entry, in no cold set) get their entry, head-map slot, chain count and
link in one loop with no helper call per key (`_new_fills`), ~1 µs per block where the general
path (`_add` + `_born` + `_link`, a Rust cold-set call per tier and key) took ~5
(benches/RESULTS.md 22.perf). Whether a key is cold is asked once per set for the batch
(`_cold_among`). Keys that are cold (warming) or known go the general way; the result is the
same state either way (tests/test_host_fills.py compares the two on random batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from flexkv_py.index.cold_blocks import key_digest
from flexkv_py.index.entry import Entry, IndexStateError
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.lower_room import LowerRoom

# A new fill's entry is built positionally (a store makes one per block; keywords cost ~50 %
# more): the order below must be Entry's, checked once at import.
_FILLING_FIELDS = ("host_slot", "host_ready", "evicting", "releasing", "lower", "pending", "pins")
if tuple(f.name for f in fields(Entry))[: len(_FILLING_FIELDS) + 1] != (*_FILLING_FIELDS, "hits"):
    raise ImportError("Entry's fields changed: update host_fills._filling_entry")


def _filling_entry(slot: int, hits: int) -> Entry:
    """The entry of a block never cached whose host fill begins: pinned once, not ready."""
    return Entry(slot, False, False, False, 0, 0, 1, hits)


class HostFills(LowerRoom):
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
            self._new_fills(keys, slots, parents, self._cold_among(keys), count_access)

    def _begin_fill(self, key: bytes, slot: int, parent: bytes | None, count_access: bool) -> None:
        """The general path of one key (lock held): a cold block warming, or a known key."""
        e = self._entries.get(key)
        if e is None:
            e = self._add(key)
            if not e.lower:  # not a cold block warming: cached for the first time
                self._born(e, parent if parent != key else None)
        elif e.host_slot is not None or e.stale:
            raise IndexStateError(f"key {key.hex()} has a host copy or is stale")
        e.host_slot = slot
        e.host_ready = False
        if count_access:
            e.hits += 1
        e.pins += 1
        self._policy.remove(key)  # pinned: not evictable (what _refresh does here)
        if parent is not None and parent != key and self.keep_chains:
            self._link(e, parent)

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

    def _new_fills(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        parents: Sequence[bytes | None],
        cold: bytes | None,
        count_access: bool,
    ) -> None:
        """Begin the fills (lock held). A key never cached gets its entry in one step: what
        `_add` + `_born` + `_link` do for a block with no lower-tier copy, no kids and no
        place in the policy (it had no entry), inlined; the others go through `_begin_fill`.
        All checks come first, so a bad batch changes nothing."""
        entries = self._entries
        for key in keys:
            e = entries.get(key)
            if e is not None and (e.host_slot is not None or e.stale):
                raise IndexStateError(f"key {key.hex()} has a host copy or is stale")
        if len(set(keys)) != len(keys):
            raise IndexStateError("a key appears twice in one batch of host fills")
        by_head, ghost = self._by_head, self._ghost
        children, kids, policy_remove = self._children, self._kids, self._policy.remove
        link, cold_has, bump = self.keep_chains, self._cold.has, int(count_access)
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
                    self._kid_added(e.up)
                if link:
                    e.parent = parent
                    children[parent] = children.get(parent, 0) + 1
                    if parent is not born:  # a key made here is in no policy yet
                        pe = entries.get(parent)
                        if pe is None or not pe.lower:
                            policy_remove(parent)
            born = key

    def commit_host_fill(self, key: bytes, ok: bool) -> bool:
        """End a fill and unpin; a failed fill frees its slot. True if the copy is readable."""
        return bool(self.commit_host_fills((key,), (ok,)))

    def commit_host_fills(self, keys: Sequence[bytes], oks: Sequence[bool]) -> list[bytes]:
        """`commit_host_fill` for many keys under one lock (a store's blocks). Returns the keys
        whose host copy is readable now (not those that failed or were reset meanwhile)."""
        readable: list[bytes] = []
        with self._lock:
            entries, policy = self._entries, self._policy
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
                        # The common case (a stored block): it becomes evictable, nothing else.
                        if key not in policy and (e.lower or key not in self._children):
                            policy.add(key, e.hits)
                        continue
                else:
                    self._slots.give(e.host_slot)
                    e.host_slot = None
                    self._unlink(e)
                self._settle(key, e)
        return readable
