"""Namespace, eviction/admission policies and the tier index (incl. a hypothesis state machine)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flexkv_py.config.admission import AdmissionSpec
from flexkv_py.errors import ConfigError
from flexkv_py.index import (
    LOWER_TIERS,
    AdmissionPolicy,
    FIFOPolicy,
    IndexStateError,
    LFUPolicy,
    LRUPolicy,
    Namespace,
    Tier,
    TierIndex,
    make_eviction_policy,
)


def _ns(**kw: object) -> Namespace:
    base: dict[str, object] = dict(
        model="Qwen/Qwen3-8B",
        revision="main",
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=16,
        tp_size=2,
        hash_algo="sha256",
        page_bytes=1179648,
    )
    base.update(kw)
    return Namespace(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------- namespace
def test_namespace_prefix_is_stable_and_rank_independent() -> None:
    a, b = _ns(tp_rank=0), _ns(tp_rank=1)
    assert a.prefix == b.prefix and len(a.prefix) == 16
    assert a.key(b"\x01" * 32) == b.key(b"\x01" * 32)
    assert a.prefix == _ns().prefix  # deterministic
    # cosmetic spellings of the same identity agree
    assert _ns(kv_dtype="torch.bfloat16", kv_layout="lbnhc").prefix == a.prefix


@pytest.mark.parametrize(
    "change",
    [
        {"model": "Qwen/Qwen3-0.6B"},
        {"revision": "v2"},
        {"kv_dtype": "float16"},
        {"kv_layout": "LBHNC"},
        {"block_size": 32},
        {"tp_size": 4},
        {"pp_size": 2},
        {"hash_algo": "xxhash"},
        {"page_bytes": 4096},
    ],
)
def test_namespace_fields_isolate(change: dict[str, object]) -> None:
    base, other = _ns(), _ns(**change)
    h = b"\xab" * 32
    assert base.key(h) != other.key(h)
    assert not other.owns(base.key(h))


def test_namespace_keys_and_shards() -> None:
    ns0, ns1 = _ns(tp_rank=0), _ns(tp_rank=1)
    hashes = [bytes([i]) * 32 for i in range(3)]
    keys = ns0.keys(hashes)
    assert [ns0.block_hash(k) for k in keys] == hashes
    sk0, sk1 = ns0.storage_key(keys[0]), ns1.storage_key(keys[0])
    assert sk0 != sk1
    assert ns0.logical_key(sk0) == keys[0]
    assert ns0.logical_key(sk1) is None  # another rank's block
    assert ns0.shard_dir_name == "tp0-pp0" and ns1.shard_dir_name == "tp1-pp0"
    assert ns0.for_rank(1) == ns1
    with pytest.raises(ValueError):
        _ns(model="other").block_hash(keys[0])


@pytest.mark.parametrize(
    "bad",
    [{"model": ""}, {"block_size": 0}, {"tp_rank": 2}, {"pp_rank": -1}, {"page_bytes": -1}],
)
def test_namespace_rejects_bad_fields(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _ns(**bad)


# ---------------------------------------------------------------- policies
def test_lru_order() -> None:
    p = LRUPolicy()
    for k in "abc":
        p.add(k)
    p.touch("a")
    assert [p.pop_victim() for _ in range(3)] == ["b", "c", "a"]
    assert p.pop_victim() is None


def test_fifo_ignores_touch() -> None:
    p = FIFOPolicy()
    for k in "abc":
        p.add(k)
    p.touch("a")
    p.add("a")  # re-adding a tracked key keeps its place
    assert [p.pop_victim() for _ in range(3)] == ["a", "b", "c"]


def test_lfu_order_and_ties() -> None:
    p = LFUPolicy()
    p.add("a", freq=3)
    p.add("b")
    p.add("c")
    p.touch("b")  # b: 2, c: 1
    assert p.pop_victim() == "c"
    assert p.remove("b") and not p.remove("b")
    assert p.pop_victim() == "a"
    assert len(p) == 0 and p.pop_victim() is None
    # frequencies saturate instead of growing without bound
    p.add("hot", freq=10**9)
    for _ in range(100):
        p.touch("hot")
    p.add("new")
    assert p.pop_victim() == "new"


def test_make_eviction_policy() -> None:
    assert isinstance(make_eviction_policy("LFU"), LFUPolicy)
    with pytest.raises(ConfigError, match="eviction_policy"):
        make_eviction_policy("clock")


def test_admission_policy() -> None:
    wb = AdmissionPolicy(AdmissionSpec("write_back", 1))
    assert not wb.admit_on_store(5) and wb.admit_on_evict(1)
    wt = AdmissionPolicy(AdmissionSpec("write_through", 1))
    assert wt.admit_on_store(1) and wt.admit_on_evict(1)
    freq = AdmissionPolicy(AdmissionSpec("write_through", 3))
    assert not freq.admit_on_store(2) and freq.admit_on_store(3)
    assert not freq.admit_on_evict(2) and freq.admit_on_evict(3)


# ---------------------------------------------------------------- tier index
def _k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def _fill(idx: TierIndex, key: bytes) -> int:
    (slot,) = idx.allocate_slots(1)
    idx.begin_host_fill(key, slot)
    idx.commit_host_fill(key, ok=True)
    return slot


def test_longest_prefix_from_block_zero() -> None:
    idx = TierIndex(8)
    for i in (0, 1, 3):
        _fill(idx, _k(i))
    assert idx.lookup([_k(0), _k(1), _k(2), _k(3)]) == 2
    assert idx.lookup([_k(1), _k(0)]) == 2
    assert idx.lookup([_k(2), _k(0)]) == 0
    idx.set_present([_k(2)], Tier.SSD, True)
    assert idx.match([_k(0), _k(1), _k(2), _k(3)]) == [Tier.HOST, Tier.HOST, Tier.SSD, Tier.HOST]


def test_filling_blocks_are_not_readable() -> None:
    idx = TierIndex(2)
    (slot,) = idx.allocate_slots(1)
    idx.begin_host_fill(_k(0), slot)
    assert idx.lookup([_k(0)]) == 0 and idx.known(_k(0))
    idx.commit_host_fill(_k(0), ok=False)
    assert not idx.known(_k(0)) and idx.free_slots == 2


def test_eviction_respects_pins_and_lru() -> None:
    idx = TierIndex(3)
    for i in range(3):
        _fill(idx, _k(i))
    assert idx.allocate_slots(1) == []
    idx.pin([_k(0)])
    idx.touch([_k(1)])
    v = idx.begin_evict()
    assert v is not None and v.key == _k(2)  # 0 pinned, 1 recently used
    assert idx.lookup([_k(2)]) == 1  # still readable from host while it is written out
    idx.finish_evict(v.key)
    assert idx.lookup([_k(2)]) == 0
    assert idx.free_slots == 1 and not idx.known(_k(2))
    v = idx.begin_evict()
    assert v is not None and v.key == _k(1)
    assert idx.begin_evict() is None  # only the pinned block is left
    idx.unpin([_k(0)])
    v2 = idx.begin_evict()
    assert v2 is not None and v2.key == _k(0)


def test_spilled_block_stays_readable_from_ssd() -> None:
    idx = TierIndex(1)
    _fill(idx, _k(0))
    v = idx.begin_evict()
    assert v is not None
    assert idx.begin_write(v.key, Tier.SSD)
    assert not idx.begin_write(v.key, Tier.SSD)  # already in flight
    idx.commit_write(v.key, Tier.SSD, ok=True)
    idx.finish_evict(v.key)
    assert idx.match([_k(0)]) == [Tier.SSD]
    assert idx.entry(_k(0)) is not None and idx.entry(_k(0)).host_slot is None  # type: ignore[union-attr]


def test_evicting_block_pinned_by_a_reader_frees_its_slot_on_unpin() -> None:
    idx = TierIndex(1)
    slot = _fill(idx, _k(0))
    v = idx.begin_evict()
    assert v is not None and idx.begin_write(v.key, Tier.SSD)
    got = idx.acquire([_k(0)])  # a load reads the host copy during the spill
    assert [g.tier for g in got] == [Tier.HOST] and got[0].host_slot == slot
    idx.commit_write(v.key, Tier.SSD, ok=True)
    idx.finish_evict(v.key)
    assert idx.free_slots == 0  # the reader still uses the slot
    assert idx.match([_k(0)]) == [Tier.SSD]  # new readers go to SSD
    with pytest.raises(IndexStateError):
        idx.begin_host_fill(_k(0), 0)
    idx.unpin([_k(0)])
    assert idx.free_slots == 1 and idx.match([_k(0)]) == [Tier.SSD]


def test_ghost_hits_survive_eviction() -> None:
    idx = TierIndex(1)
    _fill(idx, _k(0))
    idx.touch([_k(0)])
    v = idx.begin_evict()
    assert v is not None and v.hits == 2
    idx.finish_evict(v.key)
    assert idx.hits(_k(0)) == 2
    _fill(idx, _k(0))
    assert idx.hits(_k(0)) == 3


def test_reset_makes_in_use_blocks_stale() -> None:
    idx = TierIndex(2)
    _fill(idx, _k(0))
    _fill(idx, _k(1))
    idx.set_present([_k(1)], Tier.SSD, True)
    idx.pin([_k(0)])
    removed = idx.reset()
    assert [k for k, _ in removed] == [_k(1)]
    assert idx.lookup([_k(0)]) == 0 and idx.lookup([_k(1)]) == 0
    assert idx.free_slots == 1
    with pytest.raises(IndexStateError):
        idx.begin_host_fill(_k(0), 1)
    idx.unpin([_k(0)])
    assert idx.free_slots == 2 and len(idx) == 0


def test_invalid_transitions_raise() -> None:
    idx = TierIndex(1)
    with pytest.raises(IndexStateError):
        idx.unpin([_k(0)])
    _fill(idx, _k(0))
    with pytest.raises(IndexStateError):
        idx.commit_host_fill(_k(0), ok=True)
    with pytest.raises(IndexStateError):
        idx.finish_evict(_k(0))


def test_index_state_error_is_a_flexkv_error() -> None:
    from flexkv_py.errors import FlexKVError, InternalStateError

    idx = TierIndex(1)
    with pytest.raises(IndexStateError) as info:
        idx.unpin([_k(0)])
    assert isinstance(info.value, InternalStateError)
    assert isinstance(info.value, FlexKVError) and isinstance(info.value, RuntimeError)


def test_object_tier_runs_through_the_same_transitions() -> None:
    idx = TierIndex(1)
    _fill(idx, _k(0))
    v = idx.begin_evict()
    assert v is not None and v.lower == frozenset()
    assert idx.begin_write(v.key, Tier.OBJECT) and idx.begin_write(v.key, Tier.SSD)
    idx.commit_write(v.key, Tier.OBJECT, ok=True)
    idx.commit_write(v.key, Tier.SSD, ok=False)
    idx.finish_evict(v.key)
    assert idx.match([_k(0)]) == [Tier.OBJECT] and idx.readable_on(_k(0), Tier.OBJECT)
    assert not idx.readable_on(_k(0), Tier.SSD)
    idx.set_present([_k(0)], Tier.SSD, True)
    assert idx.match([_k(0)]) == [Tier.SSD]  # the faster lower tier first
    assert idx.counts()["on_object"] == 1 and idx.counts()["on_ssd"] == 1
    idx.pin([_k(0)])
    idx.reset()
    idx.unpin([_k(0)])
    assert idx.take_garbage() == {Tier.SSD: [_k(0)], Tier.OBJECT: [_k(0)]}


def test_a_reset_keeps_the_lower_deletes_it_has_not_sent() -> None:
    """Copies the index evicted by key but whose deletes no job carried yet still leave the
    tier after a reset: they go out with the next job (and are announced then)."""
    idx = TierIndex(3)
    for i in range(3):
        _fill(idx, _k(i))
    idx.set_present([_k(i) for i in range(3)], Tier.SSD, True)
    idx.set_lower_capacity(Tier.SSD, 1)  # evicts two copies by key, deletes not taken yet
    idx.reset()
    evicted = idx.take_lower_evictions()
    assert len(evicted[Tier.SSD]) == 2 and set(evicted[Tier.SSD]) < {_k(i) for i in range(3)}


def test_cold_blocks_keep_no_keys_and_a_reset_keeps_what_it_cleared() -> None:
    """Cold blocks are fingerprints only: they are recognised among candidates (each once, in
    the order given), not listed; blocks that warm up and cool again stay recognised once; a
    reset returns no cold key (the worker deletes by namespace) and keeps the cleared sets,
    which answer for exactly the blocks that were cold."""
    head = b"H" * 24
    keys = [head + i.to_bytes(32, "big") for i in range(6000)]
    idx = TierIndex(4)
    assert idx.set_present(keys, Tier.SSD, True) == keys
    cold = idx._cold
    assert cold.keys_among(keys + keys[:5]) == keys and cold.arena_bytes() == 0
    used = keys[:3000:2]  # loaded: warm while pinned, cold again after
    got = idx.acquire(used[:1])
    assert [g.tier for g in got] == [Tier.SSD] and idx.entry(used[0]) is not None
    assert used[0] not in cold.keys_among(used[:1])  # warm: an entry, not cold
    idx.unpin(used[:1])
    for key in used[1:]:
        idx.pin([key])
        idx.unpin([key])
    gone = keys[1:3000:2]
    assert idx.set_present(gone, Tier.SSD, False) == gone
    left = [k for k in keys if k not in set(gone)]
    assert cold.keys_among(keys) == left and idx.cold_keys_among(gone) == []
    assert idx.lookup(left) == len(left) and idx.lookup(gone[:1]) == 0
    assert idx.reset() == [] and cold.keys_among(keys) == []
    (forgotten,) = idx.take_forgotten()
    assert [k for k in keys if forgotten.held(k, Tier.SSD)] == left
    assert not any(forgotten.held(k, Tier.OBJECT) for k in left)
    assert idx.take_forgotten() == []


def test_concurrent_fill_pin_evict() -> None:
    n_threads, per_thread, slots = 4, 300, 64
    idx = TierIndex(slots)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(per_thread):
                key = _k(t * 10_000 + i)
                got = idx.allocate_slots(1)
                while not got:
                    v = idx.begin_evict()
                    if v is not None:
                        idx.finish_evict(v.key)
                    got = idx.allocate_slots(1)
                idx.begin_host_fill(key, got[0])
                idx.commit_host_fill(key, ok=True)
                # another thread may evict it right after commit; acquire is atomic
                got = idx.acquire([key])
                if got:
                    assert got[0].tier is Tier.HOST and got[0].host_slot is not None
                    assert idx.lookup([key]) == 1
                    idx.unpin([key])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    counts = idx.counts()
    assert counts["host_ready"] + counts["free_slots"] == slots
    assert counts["pinned"] == 0 and counts["evicting"] == 0


# ---------------------------------------------------------------- state machine
@dataclass
class _M:
    host: str = "none"  # none | filling | ready | evicting | releasing
    slot: int | None = None
    lower: set[Tier] = field(default_factory=set)  # confirmed lower-tier copies
    pending: set[Tier] = field(default_factory=set)  # lower-tier writes in flight
    pins: int = 0
    hits: int = 0
    stale: bool = False
    parent: bytes | None = None  # chain parent, linked while the host copy is held


# Logical-key shaped (24-byte head + 32-byte hash, two heads) so the index's per-head map of
# block hashes is exercised too; one short key stays outside it.
_HEADS = (b"A" * 24, b"B" * 24)
KEYS = [_HEADS[0] + _k(0) * 8, _HEADS[0] + _k(1) * 8, _HEADS[1] + _k(2) * 8, _k(3)]
SLOTS = 3
key_st = st.sampled_from(KEYS)
tier_st = st.sampled_from(LOWER_TIERS)  # the object tier runs through the same transitions


class TierIndexMachine(RuleBasedStateMachine):
    """Drives TierIndex with random transitions and checks it against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = TierIndex(SLOTS, eviction=LRUPolicy())
        self.m: dict[bytes, _M] = {}
        self.free = SLOTS
        self.ghost: dict[bytes, int] = {}
        self.garbage: dict[Tier, list[bytes]] = {}
        self.tier_lost: set[bytes] = set()  # lost a lower copy by its tier's word (set_present)

    # -- model helpers
    def _settle(self, key: bytes) -> None:
        e = self.m[key]
        if e.host == "releasing" and e.pins == 0:
            self.free += 1
            e.host, e.slot = "none", None
        if e.stale and e.pins == 0 and e.host != "evicting":
            if e.host == "ready":
                self.free += 1
                e.host, e.slot, e.parent = "none", None, None
            for tier in e.lower:
                self.garbage.setdefault(tier, []).append(key)
            e.lower.clear()
        if e.host == "none" and not e.lower and not e.pending and e.pins == 0:
            del self.m[key]
            if not e.stale:
                self.ghost[key] = e.hits

    def _evictable(self) -> set[bytes]:
        # Prefix-aware: a block with a linked (host-resident) child is no chain tail.
        # A parent that has a lower-tier copy stays cached when it leaves host: evictable.
        parents = {e.parent for e in self.m.values() if e.parent is not None}
        return {
            k
            for k, e in self.m.items()
            if e.host == "ready" and e.pins == 0 and not e.stale and (e.lower or k not in parents)
        }

    def _new(self, key: bytes) -> _M:
        if key not in self.m:
            self.m[key] = _M(hits=self.ghost.pop(key, 0))
        return self.m[key]

    # -- rules (keys drawn from the states where the transition is legal; `bad_calls` covers
    # the illegal ones)
    def _where(self, pred: Callable[[_M], bool]) -> list[bytes]:
        return sorted(k for k, e in self.m.items() if pred(e))

    @precondition(lambda self: self.free > 0)
    @rule(key=key_st)
    def begin_fill(self, key: bytes) -> None:
        e = self.m.get(key)
        (slot,) = self.idx.allocate_slots(1)
        if e is not None and (e.host != "none" or e.stale):
            with pytest.raises(IndexStateError):
                self.idx.begin_host_fill(key, slot)
            self.idx.release_slots([slot])
            return
        self.idx.begin_host_fill(key, slot)
        e = self._new(key)
        self.free -= 1
        e.host, e.slot, e.pins, e.hits = "filling", slot, e.pins + 1, e.hits + 1

    @precondition(
        lambda self: (
            self.free > 0 and any(e.host == "ready" and not e.stale for e in self.m.values())
        )
    )
    @rule(data=st.data())
    def begin_fill_child(self, data: st.DataObject) -> None:
        """A chain's next block enters the host tier under a parent whose copy is ready."""
        parent = data.draw(
            st.sampled_from(self._where(lambda e: e.host == "ready" and not e.stale))
        )
        fresh = [k for k in KEYS if k != parent and (k not in self.m or self.m[k].host == "none")]
        fresh = [k for k in fresh if k not in self.m or not self.m[k].stale]
        if not fresh:
            return
        key = data.draw(st.sampled_from(fresh))
        (slot,) = self.idx.allocate_slots(1)
        self.idx.begin_host_fill(key, slot, parent=parent)
        e = self._new(key)
        self.free -= 1
        e.host, e.slot, e.pins, e.hits = "filling", slot, e.pins + 1, e.hits + 1
        e.parent = parent

    @invariant()
    def every_cached_child_has_its_parent_cached(self) -> None:
        for key, e in self.m.items():
            if e.parent is not None and e.host in ("ready", "evicting") and not e.stale:
                if e.parent in self.tier_lost:
                    continue  # the lower tier's own eviction: not the host tier's order
                p = self.m[e.parent]
                assert p.host == "ready" or p.lower
                assert len(self.idx.match([e.parent, key])) == 2

    @precondition(lambda self: any(e.host == "filling" for e in self.m.values()))
    @rule(data=st.data(), ok=st.booleans())
    def commit_fill(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(self._where(lambda e: e.host == "filling")))
        e = self.m[key]
        self.idx.commit_host_fill(key, ok)
        e.pins -= 1
        if ok:
            e.host = "ready"
        else:
            e.host, e.slot, e.parent = "none", None, None
            self.free += 1
        self._settle(key)

    @precondition(lambda self: bool(self.m))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.m)))
        self.idx.pin([key])
        self.m[key].pins += 1

    @staticmethod
    def _extra_pins(e: _M) -> int:
        # the fill's own pin is released by commit, never by unpin
        return e.pins - (1 if e.host == "filling" else 0)

    @precondition(lambda self: any(self._extra_pins(e) > 0 for e in self.m.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._where(lambda e: self._extra_pins(e) > 0)))
        self.idx.unpin([key])
        self.m[key].pins -= 1
        self._settle(key)

    @precondition(lambda self: any(e.host == "evicting" for e in self.m.values()))
    @rule(data=st.data())
    def finish_evict(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._where(lambda e: e.host == "evicting")))
        e = self.m[key]
        self.idx.finish_evict(key)
        e.host, e.parent = "releasing", None  # freed now if unpinned, else by the last unpin
        self._settle(key)

    @precondition(lambda self: bool(self.m))
    @rule(data=st.data(), tier=tier_st)
    def begin_write(self, data: st.DataObject, tier: Tier) -> None:
        key = data.draw(st.sampled_from(sorted(self.m)))
        e = self.m[key]
        started = self.idx.begin_write(key, tier)
        assert started == (not (tier in e.lower or tier in e.pending or e.stale))
        if started:
            e.pending.add(tier)

    @precondition(lambda self: any(e.pending for e in self.m.values()))
    @rule(data=st.data(), ok=st.booleans())
    def commit_write(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(self._where(lambda e: bool(e.pending))))
        e = self.m[key]
        tier = data.draw(st.sampled_from(sorted(e.pending)))
        self.idx.commit_write(key, tier, ok)
        e.pending.discard(tier)
        if ok:
            e.lower.add(tier)
        self._settle(key)

    @rule(key=key_st, tier=tier_st)
    def bad_calls(self, key: bytes, tier: Tier) -> None:
        e = self.m.get(key)
        if e is None:
            with pytest.raises(IndexStateError):
                self.idx.pin([key])
        if e is None or self._extra_pins(e) <= 0:
            if e is None or e.pins == 0:
                with pytest.raises(IndexStateError):
                    self.idx.unpin([key])
        if e is None or e.host != "filling":
            with pytest.raises(IndexStateError):
                self.idx.commit_host_fill(key, True)
        if e is None or e.host != "evicting":
            with pytest.raises(IndexStateError):
                self.idx.finish_evict(key)
        if e is None or tier not in e.pending:
            with pytest.raises(IndexStateError):
                self.idx.commit_write(key, tier, True)

    @rule(key=key_st)
    def touch(self, key: bytes) -> None:
        self.idx.touch([key])
        if key in self.m:
            self.m[key].hits += 1

    @rule()
    def begin_evict(self) -> None:
        expected = self._evictable()
        v = self.idx.begin_evict()
        if not expected:
            assert v is None
            return
        assert v is not None and v.key in expected
        e = self.m[v.key]
        assert v.host_slot == e.slot and v.hits == e.hits and v.lower == e.lower
        e.host = "evicting"

    @rule(key=key_st, tier=tier_st, present=st.booleans())
    def set_present(self, key: bytes, tier: Tier, present: bool) -> None:
        changed = self.idx.set_present([key], tier, present)
        e = self.m.get(key)
        if present:
            e = self._new(key)
            expect = tier not in e.lower and not e.stale
            if expect:
                e.lower.add(tier)
        else:
            expect = e is not None and tier in e.lower
            if e is not None and tier in e.lower:
                e.lower.discard(tier)
                self.tier_lost.add(key)
                self._settle(key)
        assert changed == ([key] if expect else [])

    @rule()
    def reset(self) -> None:
        cold = set(self.idx.cold_keys_among(KEYS))
        removed = {k for k, _ in self.idx.reset()}
        # Cold blocks are fingerprints: the reset keeps what it cleared (`take_forgotten`)
        # for the workers' namespace delete to be announced by.
        forgotten = self.idx.take_forgotten()
        held = {k for k in KEYS for f in forgotten for t in LOWER_TIERS if f.held(k, t)}
        assert held == cold and not removed & cold
        removed |= held
        expect = set()
        for k, e in list(self.m.items()):
            e.stale, e.parent = True, None
            if e.pins == 0 and e.host not in ("filling", "evicting") and not e.pending:
                if e.slot is not None:
                    self.free += 1
                del self.m[k]
                expect.add(k)
        self.ghost.clear()
        assert removed == expect

    @rule()
    def take_garbage(self) -> None:
        got = self.idx.take_garbage()
        assert {t: sorted(ks) for t, ks in got.items()} == {
            t: sorted(ks) for t, ks in self.garbage.items()
        }
        self.garbage.clear()

    @rule(keys=st.lists(key_st, max_size=6), pin=st.booleans())
    def match(self, keys: list[bytes], pin: bool) -> None:
        expected: list[Tier] = []
        for k in keys:
            e = self.m.get(k)
            if e is None or e.stale:
                break
            if e.host in ("ready", "evicting"):
                expected.append(Tier.HOST)
            elif e.lower:
                expected.append(next(t for t in LOWER_TIERS if t in e.lower))  # fastest first
            else:
                break
        if not pin:
            assert self.idx.match(keys) == expected
            # The scheduler's fast path agrees with match on every state, from any start.
            assert self.idx.lookup(keys) == len(expected)
            for start in range(len(keys) + 1):
                hit = len(self.idx.match(keys[start:]))
                assert self.idx.readable_prefix(keys, start) == start + hit
                assert self.idx.readable_prefix(keys, start, start + 1) == start + min(hit, 1)
                heads = {k[:24] for k in keys}
                if len(heads) == 1 and all(len(k) > 24 for k in keys):
                    hashes = [k[24:] for k in keys]
                    got = self.idx.readable_hashes(heads.pop(), hashes, start)
                    assert got == start + hit
            return
        got = self.idx.acquire(keys)
        assert [g.tier for g in got] == expected
        for g, k in zip(got, keys, strict=False):
            assert g.host_slot == (self.m[k].slot if g.tier is Tier.HOST else None)
        for k in keys[: len(expected)]:
            self.m[k].pins += 1

    # -- invariants
    @invariant()
    def slots_are_conserved(self) -> None:
        held = [e.slot for e in self.m.values() if e.slot is not None]
        assert len(held) == len(set(held))
        assert self.idx.free_slots == self.free == SLOTS - len(held)

    @invariant()
    def hashes_by_head_mirror_entries(self) -> None:
        by_head = self.idx._core.by_head
        long_keys = {k for k in self.idx._entries if len(k) > 24}
        assert sum(len(sub) for sub in by_head.values()) == len(long_keys)
        assert all(sub for sub in by_head.values())
        for k in long_keys:
            assert by_head[k[:24]][k[24:]] is self.idx._entries[k]

    @invariant()
    def cold_blocks_have_no_entry(self) -> None:
        """A block with only lower-tier copies and nothing in flight is cold (in the per-tier
        sets, no Entry); every other block is an Entry; never both."""
        cold = {
            k
            for k, e in self.m.items()
            if e.host == "none" and e.pins == 0 and not e.pending and not e.stale and e.lower
            if len(k) > 24
        }
        assert set(self.idx._cold.keys_among(KEYS)) == cold  # KEYS: every key the test uses
        assert not cold & set(self.idx._entries)
        for tier in LOWER_TIERS:
            on = {k for k in cold if tier in self.m[k].lower}
            assert self.idx.counts()[f"cold_{tier.value}"] == len(on)

    @invariant()
    def entries_agree(self) -> None:
        assert set(self.idx.keys()) | set(self.idx.cold_keys_among(KEYS)) == set(self.m)
        for k, e in self.m.items():
            got = self.idx.entry(k)
            assert got is not None
            assert got.host_slot == e.slot
            assert got.host_ready == (e.host in ("ready", "evicting"))
            assert got.evicting == (e.host == "evicting")
            assert got.releasing == (e.host == "releasing")
            assert (got.lower_tiers, got.pending_tiers, got.pins, got.stale) == (
                e.lower,
                e.pending,
                e.pins,
                e.stale,
            )
            assert self.idx.hits(k) == e.hits
        assert self.idx.counts()["evictable"] == len(self._evictable())


TierIndexMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_tier_index_state_machine = TierIndexMachine.TestCase
