"""`_native.BlockSet`: the compact presence set, against a Python reference (an OrderedDict of
full keys in LRU order), plus its digest format, bad input and concurrent use."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flexkv_py._native import BlockSet, content_hash

# Two namespace heads (24 bytes, as the index's) and one short one; hashes of several lengths.
# head + hash is what identifies a key, so (b"", b"AB") and (b"A", b"B") are one key.
HEADS = (b"A" * 24, b"B" * 24, b"A")
HASHES = (b"", b"A", b"x" * 8, b"y" * 32, b"A" * 23, b"z" * 200)
PAIRS = [(h, x) for h in HEADS for x in HASHES]

head_st = st.sampled_from(HEADS)
hash_st = st.sampled_from(HASHES)
key_st = st.sampled_from([h + x for h, x in PAIRS])


def digest_of(key: bytes) -> bytes:
    return BlockSet.digest(key, b"")


class _Seq(Sequence[bytes]):
    """A sequence that is neither list nor tuple (the generic path)."""

    def __init__(self, items: Sequence[bytes]) -> None:
        self._items = list(items)

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        return self._items[i]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._items)


def as_kind(items: list[bytes], kind: str) -> Any:
    return {"list": items, "tuple": tuple(items), "seq": _Seq(items)}[kind]


kind_st = st.sampled_from(("list", "tuple", "seq"))


class BlockSetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = BlockSet()
        self.m: OrderedDict[bytes, None] = OrderedDict()

    def _apply(self, add: bool, key: bytes) -> bool:
        """The reference's add or discard: True if it changed the set."""
        if add == (key in self.m):
            return False
        if add:
            self.m[key] = None
        else:
            del self.m[key]
        return True

    @rule(add=st.booleans(), head=head_st, h=hash_st)
    def add_or_discard(self, add: bool, head: bytes, h: bytes) -> None:
        call = self.s.add if add else self.s.discard
        assert call(head, h) == self._apply(add, head + h)

    @rule(add=st.booleans(), key=key_st)
    def add_or_discard_key(self, add: bool, key: bytes) -> None:
        call = self.s.add_key if add else self.s.discard_key
        assert call(key) == self._apply(add, key)

    @rule(add=st.booleans(), keys=st.lists(key_st, max_size=8), kind=kind_st)
    def add_or_discard_keys(self, add: bool, keys: list[bytes], kind: str) -> None:
        call = self.s.add_keys if add else self.s.discard_keys
        assert call(as_kind(keys, kind)) == sum(self._apply(add, k) for k in keys)

    @rule(add=st.booleans(), keys=st.lists(key_st, max_size=8))
    def add_or_discard_digests(self, add: bool, keys: list[bytes]) -> None:
        call = self.s.add_digests if add else self.s.discard_digests
        assert call([digest_of(k) for k in keys]) == sum(self._apply(add, k) for k in keys)

    @rule(head=head_st, h=hash_st)
    def contains(self, head: bytes, h: bytes) -> None:
        assert self.s.contains(head, h) == (head + h in self.m)
        assert (head + h in self.s) == (head + h in self.m)

    @rule(head=head_st, hashes=st.lists(hash_st, max_size=10), kind=kind_st, data=st.data())
    def prefix_run_and_mask(
        self, head: bytes, hashes: list[bytes], kind: str, data: st.DataObject
    ) -> None:
        start = data.draw(st.integers(0, len(hashes)))
        stop = data.draw(st.integers(start, len(hashes)))
        mask = bytes(head + h in self.m for h in hashes[start:stop])
        run = (mask + b"\0").index(b"\0")
        seq = as_kind(hashes, kind)
        assert self.s.prefix_run(head, seq, start, stop) == run
        assert self.s.present_mask(head, seq, start, stop) == mask

    @rule(head=head_st, hashes=st.lists(hash_st, max_size=6), kind=kind_st)
    def touch(self, head: bytes, hashes: list[bytes], kind: str) -> None:
        self.s.touch(head, as_kind(hashes, kind))
        for h in hashes:
            if head + h in self.m:
                self.m.move_to_end(head + h)

    @rule(n=st.integers(0, 6))
    def pop_lru(self, n: int) -> None:
        expect = [digest_of(self.m.popitem(last=False)[0]) for _ in range(min(n, len(self.m)))]
        assert self.s.pop_lru(n) == expect

    @rule(keys=st.lists(key_st, max_size=12))
    def intersect_update(self, keys: list[bytes]) -> None:
        other = BlockSet()
        other.add_keys(keys)
        self.s.intersect_update(other)
        for k in [k for k in self.m if k not in keys]:
            del self.m[k]
        assert len(other) == len(set(keys)), "the other set is not changed"

    @rule()
    def intersect_with_itself(self) -> None:
        self.s.intersect_update(self.s)

    @rule()
    def clear(self) -> None:
        self.s.clear()
        self.m.clear()
        assert self.s.nbytes() == 0

    @invariant()
    def same_members_in_lru_order(self) -> None:
        assert len(self.s) == len(self.m)
        assert self.s.digests() == [digest_of(k) for k in self.m]

    @invariant()
    def nbytes_covers_every_entry(self) -> None:
        # 16-byte arena node (8-byte fingerprint + LRU links) + a 4-byte table slot, at the
        # least: past 80 % load the table's 16-slot floor and the arena's 16-node steps keep
        # sets of this universe (<= 18 keys) above 21 B.
        assert self.s.nbytes() >= 21 * len(self.m)


BlockSetMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
test_block_set_state_machine = BlockSetMachine.TestCase


def test_digest_is_xxh3_128_of_the_full_key() -> None:
    """A key is kept as an 8-byte fingerprint: the first 8 bytes of xxh3-128 of head + hash."""
    head, h = b"H" * 24, b"\x01" * 32
    d = BlockSet.digest(head, h)
    assert len(d) == 8
    assert d == content_hash(head + h, "xxh3-128")[:8] == BlockSet().digest(head + h, b"")
    long_hash = bytes(range(256)) * 2  # past the stack-copy path
    assert BlockSet.digest(head, long_hash) == content_hash(head + long_hash, "xxh3-128")[:8]
    s = BlockSet()
    assert s.add(head, h) and not s.add_key(head + h) and head + h in s
    assert s.digests() == [d]


@pytest.mark.parametrize("kind", ["list", "tuple", "seq"])
@pytest.mark.parametrize("start", [0, 7])
def test_prefix_run_across_chunk_boundaries(kind: str, start: int) -> None:
    """prefix_run borrows hashes in growing chunks (1, 8, 64, 512, 4096, ...): a miss right
    before, at and after each boundary, and a full run."""
    head = b"N" * 24
    hashes = [i.to_bytes(8, "little") for i in range(5000)]
    s = BlockSet()
    s.add_keys([head + h for h in hashes])
    seq = as_kind(hashes, kind)
    assert s.prefix_run(head, seq, start, len(hashes)) == len(hashes) - start
    for miss in (0, 1, 2, 8, 9, 10, 72, 73, 74, 584, 585, 586, 4680, 4681, 4682, 4999):
        if miss < start:
            continue
        assert s.discard(head, hashes[miss])
        assert s.prefix_run(head, seq, start, len(hashes)) == miss - start
        assert s.prefix_run(head, seq, start, miss) == miss - start
        mask = s.present_mask(head, seq, start, len(hashes))
        assert mask.count(0) == 1 and mask.index(0) == miss - start
        assert s.add(head, hashes[miss])


def test_bad_ranges_are_value_errors() -> None:
    s, head = BlockSet(), b"h" * 24
    hashes = [b"a", b"b"]
    s.add(head, b"a")
    for start, stop in ((2, 1), (3, 3), (0, 3), (-1, 1), (0, -1)):
        with pytest.raises(ValueError):
            s.prefix_run(head, hashes, start, stop)
        with pytest.raises(ValueError):
            s.present_mask(head, hashes, start, stop)
    assert s.prefix_run(head, hashes, 2, 2) == 0 and s.present_mask(head, hashes, 2, 2) == b""
    assert s.prefix_run(head, hashes, 0, 2) == 1
    with pytest.raises(ValueError):
        s.pop_lru(-1)
    with pytest.raises(ValueError):
        s.reserve(-1)
    with pytest.raises(ValueError, match="at most"):
        s.reserve(2**32)
    with pytest.raises(ValueError, match="8 bytes"):
        s.discard_digests([BlockSet.digest(head, b"a"), b"short"])
    with pytest.raises(ValueError, match="8 bytes"):
        s.add_digests([b"x" * 17])
    assert len(s) == 1, "a rejected call changes nothing"


def test_non_bytes_are_type_errors() -> None:
    s, head = BlockSet(), b"h" * 24
    with pytest.raises(TypeError):
        s.add("h", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        s.add(head, bytearray(b"x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        s.add_key(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keys\[1\] must be bytes"):
        s.add_keys([b"ok", 1])  # type: ignore[list-item]
    assert len(s) == 0, "nothing is added when an item is rejected"
    # Past one 64K chunk too: a bad last key fails the call before the first chunk is applied.
    hashes: list[Any] = [i.to_bytes(8, "little") for i in range(70_000)]
    keys: list[Any] = [head + h for h in hashes]
    s.add_keys(keys[:100])
    before = s.digests()
    calls: list[tuple[Callable[[Any], object], list[Any]]] = [
        (s.add_keys, keys),
        (s.discard_keys, keys),
        (lambda hs: s.touch(head, hs), hashes),
    ]
    for call, items in calls:
        # Reversed: a touch that went through would reorder the 100 present keys.
        with pytest.raises(TypeError, match=r"\[70000\] must be bytes"):
            call([*items[::-1], None])
        assert s.digests() == before
    for not_a_list in (b"abc", "abc", 5, None):
        with pytest.raises(TypeError):
            s.add_keys(not_a_list)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            s.prefix_run(head, not_a_list, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"hashes\[0\] must be bytes, not str"):
        s.present_mask(head, ["a"], 0, 1)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        s.touch(head, [None])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        _ = 1 in s
    with pytest.raises(TypeError):
        s.intersect_update(set())  # type: ignore[arg-type]


def test_memory_per_key_is_compact() -> None:
    head, n = b"h" * 24, 300_000
    keys = [head + i.to_bytes(32, "little") for i in range(n)]
    grown = BlockSet()
    for at in range(0, n, 1000):  # grown step by step: 1.25x arena, 64-87.5 % table load
        grown.add_keys(keys[at : at + 1000])
    assert len(grown) == n
    # 8-byte fingerprints and 4-byte table slots (16-byte digests: 29-40 B and 29-31 B per key
    # were asserted then; 8-byte slots: 34-48 B and 34-37 B).
    assert 21 * n <= grown.nbytes() <= 32 * n, grown.nbytes() / n
    s = BlockSet()
    s.add_keys(keys)  # a first fill is sized once: 16-byte nodes + 4-byte slots at 80 % load
    assert len(s) == n and s.digests() == grown.digests()
    assert 21 * n <= s.nbytes() <= 23 * n, s.nbytes() / n
    assert len(s.pop_lru(n - 1000)) == n - 1000
    assert s.nbytes() < 48 * n / 8, "memory is given back after mass removal"
    s.clear()
    assert len(s) == 0 and s.nbytes() == 0


def test_concurrent_use_from_threads() -> None:
    """Readers, writers and cross intersections (a with b beside b with a) on two sets: no
    deadlock, and the result is what the writers left."""
    head = b"T" * 24
    hashes = [i.to_bytes(8, "little") for i in range(4000)]
    a, b = BlockSet(), BlockSet()
    a.add_keys([head + h for h in hashes])
    b.add_keys([head + h for h in hashes])
    errors: list[BaseException] = []

    def run(fn: Any) -> None:
        try:
            for _ in range(30):
                fn()
        except BaseException as e:
            errors.append(e)

    jobs = [
        lambda: a.intersect_update(b),
        lambda: b.intersect_update(a),
        lambda: a.prefix_run(head, hashes, 0, len(hashes)),
        lambda: b.touch(head, hashes[::7]),
        lambda: a.present_mask(head, hashes, 10, 3000),
    ]
    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    assert len(a) == len(b) == len(hashes)
    # Writers on both sets at once: odd hashes leave a, multiples of 3 leave b.
    drop_a = [head + h for h in hashes[1::2]]
    drop_b = [head + h for h in hashes[::3]]
    writers = [
        threading.Thread(target=a.discard_keys, args=(drop_a,)),
        threading.Thread(target=b.discard_keys, args=(drop_b,)),
        threading.Thread(target=a.intersect_update, args=(b,)),
    ]
    for t in writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    a.intersect_update(b)
    expect = {head + h for i, h in enumerate(hashes) if i % 2 == 0 and i % 3 != 0}
    assert set(a.digests()) == {digest_of(k) for k in expect}


def test_chain_parents_are_named_by_8_bytes() -> None:
    """A chain link names its parent by the first 5 bytes of the parent's digest (7-byte links:
    name + u16 count); names are 8 bytes to callers, zero-padded, and any other length is
    refused by name."""
    s = BlockSet(chains=True)
    parent, child = b"h" * 24 + b"\x01" * 32, b"h" * 24 + b"\x02" * 32
    name = BlockSet.parent_name(parent)
    assert name == BlockSet.digest(parent, b"")[:5] + b"\0\0\0"
    s.add_chained(parent, None, 0)
    s.add_chained(child, name, 0)
    assert s.has_digest(name) and s.has_digest(BlockSet.digest(parent, b""))
    assert s.add_kid(BlockSet.digest(parent, b"")) and s.kids_of(parent) == 1
    assert s.pop_tails(1) == [(BlockSet.digest(child, b""), None)]  # its parent is here
    assert s.kids_of(parent) == 0
    with pytest.raises(ValueError, match="parent must be an 8-byte parent name"):
        s.add_kid(b"abc")
