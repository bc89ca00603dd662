"""The batch path of host fills (index/host_fills.py) leaves the index exactly as the general
per-key path does: entries, head map, chain counts, kid counts, policy order, cold sets, ghost
counts, then the same victims in the same order."""

from __future__ import annotations

import random
from typing import Any

import pytest

from flexkv_py.index import IndexStateError, Tier, TierIndex, host_fills
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.host_fills import POSITIONAL, FillBatch

HEADS = (b"A" * HEAD_LEN, b"B" * HEAD_LEN)


SEEN: list[bytes] = []  # every key a test made: cold keys are recognised, not listed


def _key(rng: random.Random, head: bytes = HEADS[0]) -> bytes:
    key = head + rng.randbytes(16)
    SEEN.append(key)
    return key


def _state(idx: TierIndex) -> dict[str, Any]:
    cold = idx._cold
    cold_keys = sorted(cold.keys_among(SEEN))
    return {
        "entries": dict(idx._entries),
        "by_head": {h: dict(sub) for h, sub in idx._core.by_head.items()},
        "children": dict(idx._children),
        "kids": dict(idx._kids),
        "policy": list(idx._policy.newest()),
        "ghost": list(idx._ghost.items()),
        "cold": cold_keys,
        "cold_masks": {k: cold.mask(k) for k in cold_keys},
        "cold_kids": {k: cold.kids_of(k) for k in cold_keys},
        "free": list(idx._slots.free),
        "warm_on": dict(idx._warm_on),
    }


def _history(seed: int) -> tuple[TierIndex, TierIndex, list[bytes], list[bytes], list[bytes]]:
    """Two indexes with the same random past: ready chains, cold blocks (some with kids), and
    dropped keys whose hits the ghost map remembers."""
    rng = random.Random(seed)
    pair = (TierIndex(4096), TierIndex(4096))
    ready = [_key(rng) for _ in range(40)]
    cold = [_key(rng) for _ in range(30)]
    gone = [_key(rng) for _ in range(20)]
    for idx in pair:
        idx.begin_host_fills(gone, idx.allocate_slots(len(gone)))
        idx.commit_host_fills(gone, [True] * len(gone))
        idx.touch(gone[:7])
        for _ in gone:  # every one of them dropped; the ghost map keeps their hits
            victim = idx.begin_evict()
            assert victim is not None
            idx.finish_evict(victim.key)
        assert idx.begin_evict() is None
        idx.begin_host_fills(ready, idx.allocate_slots(len(ready)), parents=[None, *ready[:-1]])
        idx.commit_host_fills(ready, [True] * len(ready))
        idx.set_present(cold, Tier.SSD, True)
        idx.set_present(cold[:5], Tier.OBJECT, True)
        idx.link_parents(dict(zip(cold[1:10], cold[:9], strict=True)))
    assert pair[0]._ghost and pair[0]._kids and not any(k in pair[0]._entries for k in gone)
    assert _state(pair[0]) == _state(pair[1])
    return pair[0], pair[1], ready, cold, gone


@pytest.mark.parametrize("seed", range(12))
def test_batch_fills_match_the_general_path(seed: int) -> None:
    batch_idx, general_idx, ready, cold, gone = _history(seed)
    rng = random.Random(1000 + seed)
    fresh = [_key(rng, rng.choice(HEADS)) for _ in range(60)]
    pool = fresh + rng.sample(cold, 12) + rng.sample(gone, 8)
    rng.shuffle(pool)
    keys = pool[:50]
    outside = [None, *ready, *cold, _key(rng)]  # parents: cached, cold, unknown or none
    parents = [
        keys[i - 1] if i and rng.random() < 0.7 else rng.choice(outside) for i in range(len(keys))
    ]
    count_access = bool(seed % 2)
    slots = batch_idx.allocate_slots(len(keys))
    assert general_idx.allocate_slots(len(keys)) == slots
    batch_idx.begin_host_fills(keys, slots, parents=parents, count_access=count_access)
    with general_idx._lock:  # the per-key path the batch path stands in for
        for key, slot, parent in zip(keys, slots, parents, strict=True):
            general_idx.fills._begin_fill(key, slot, parent, count_access)
    assert any(batch_idx.fills._cold_live)  # cold blocks were among the keys
    assert _state(batch_idx) == _state(general_idx)
    oks = [rng.random() < 0.9 for _ in keys]
    assert batch_idx.commit_host_fills(keys, oks) == general_idx.commit_host_fills(keys, oks)
    assert _state(batch_idx) == _state(general_idx)
    for idx in (batch_idx, general_idx):  # the same victims, in the same order
        order = []
        while (victim := idx.begin_evict()) is not None:
            idx.finish_evict(victim.key)
            order.append(victim.key)
        idx.order = order  # type: ignore[attr-defined]
    assert batch_idx.order == general_idx.order  # type: ignore[attr-defined]
    assert _state(batch_idx) == _state(general_idx)


def test_a_bad_batch_changes_nothing() -> None:
    batch_idx, _, ready, _, _ = _history(0)
    rng = random.Random(7)
    before = _state(batch_idx)
    fresh = [_key(rng) for _ in range(4)]
    with pytest.raises(IndexStateError, match="host copy"):
        batch_idx.begin_host_fills([*fresh, ready[3]], [4000, 4001, 4002, 4003, 4004])
    with pytest.raises(IndexStateError, match="twice"):
        batch_idx.begin_host_fills([*fresh, fresh[0]], [4000, 4001, 4002, 4003, 4004])
    with pytest.raises(ValueError, match="slots"):
        batch_idx.begin_host_fills(fresh, [4000])
    assert _state(batch_idx) == before


@pytest.mark.parametrize("first", ["none", "ready", "cold", "cold_object", "unknown"])
@pytest.mark.parametrize("count_access", [True, False])
def test_a_chain_of_new_blocks_in_one_step_matches_the_general_path(
    first: str, count_access: bool
) -> None:
    """The store's usual batch (a chain of new blocks, dropped ones among them) goes through
    `_new_chain` whole, and ends as the per-key path would, through commit and eviction."""
    batch_idx, general_idx, ready, cold, gone = _history(3)
    rng = random.Random(5)
    keys = [_key(rng) for _ in range(30)]
    keys[4:4] = gone[:6]  # dropped blocks (ghost hits) stored again
    parent0 = {
        "none": None,
        "ready": ready[-1],
        "cold": cold[20],
        "cold_object": cold[2],
        "unknown": _key(rng),
    }[first]
    parents = [parent0, *keys[:-1]]
    slots = batch_idx.allocate_slots(len(keys))
    assert general_idx.allocate_slots(len(keys)) == slots
    with batch_idx._lock:
        cold_mask = batch_idx.fills._cold_among(keys)
        assert batch_idx.fills._new_chain(FillBatch(keys, slots, parents, cold_mask, count_access))
    with general_idx._lock:
        for key, slot, parent in zip(keys, slots, parents, strict=True):
            general_idx.fills._begin_fill(key, slot, parent, count_access)
    assert _state(batch_idx) == _state(general_idx)
    oks = [i % 7 != 3 for i in range(len(keys))]
    assert batch_idx.commit_host_fills(keys, oks) == general_idx.commit_host_fills(keys, oks)
    assert _state(batch_idx) == _state(general_idx)
    orders = []
    for idx in (batch_idx, general_idx):
        order = []
        while (victim := idx.begin_evict()) is not None:
            idx.finish_evict(victim.key)
            order.append(victim.key)
        orders.append(order)
    assert orders[0] == orders[1] and len(orders[0]) > len(keys)
    assert _state(batch_idx) == _state(general_idx)


def test_batches_the_chain_step_does_not_take_change_nothing_there() -> None:
    """Not a chain, a known key, a duplicate: `_new_chain` declines and leaves no trace."""
    batch_idx, _, ready, cold, _ = _history(4)
    rng = random.Random(9)
    keys = [_key(rng) for _ in range(8)]
    before = _state(batch_idx)
    with batch_idx._lock:
        for ks, ps in (
            (keys, [None, *keys[:-2], None]),  # the last key starts a chain of its own
            ([*keys[:-1], ready[0]], [None, *keys[:-1]]),  # a cached key
            ([*keys[:-1], cold[0]], [None, *keys[:-1]]),  # a cold key
            ([*keys[:-1], keys[0]], [None, *keys[:-1]]),  # a key twice
        ):
            mask = batch_idx.fills._cold_among(ks)
            assert not batch_idx.fills._new_chain(FillBatch(ks, list(range(8)), ps, mask, True))
    assert _state(batch_idx) == before


def test_acquire_host_pins_all_or_nothing_as_acquire_would() -> None:
    """A load of host blocks: `acquire_host` pins them as `acquire` does (same slots, pins,
    hits, policy); with one block not in host memory (cold, filling, unknown) it pins nothing."""
    one, other, ready, cold, _ = _history(6)
    keys = ready[5:25]
    slots = one.acquire_host(keys, count_hits=True)
    located = other.acquire(keys, count_hits=True)
    assert slots == [loc.host_slot for loc in located] and None not in slots
    assert _state(one) == _state(other)
    rng = random.Random(11)
    filling = _key(rng)
    one.begin_host_fills([filling], one.allocate_slots(1))
    for odd in (cold[3], filling, _key(rng)):
        before = _state(one)
        assert one.acquire_host([*ready[:4], odd, ready[30]]) is None
        assert _state(one) == before


def test_lacking_on_is_readable_on_negated_per_key() -> None:
    idx, _, ready, cold, gone = _history(8)
    rng = random.Random(2)
    idx.set_present(ready[:10], Tier.SSD, True)  # host blocks with an SSD copy too
    keys = [*ready[5:15], *cold[:8], *gone[:3], _key(rng), b"short"]
    for tier in (Tier.SSD, Tier.OBJECT):
        want = [k for k in keys if not idx.readable_on(k, tier)]
        assert idx.lacking_on(keys, tier) == want
        assert 0 < len(want) < len(keys)


def test_entries_are_built_the_fast_way() -> None:
    """Entry's fields are in the order the batch paths build them positionally (otherwise they
    fall back to keywords and no chain step: right, but slower)."""
    assert POSITIONAL


@pytest.mark.parametrize("seed", range(3))
def test_keyword_entries_give_the_same_state(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for a changed Entry (keywords, no chain step) ends in the same state."""
    monkeypatch.setattr(host_fills, "POSITIONAL", False)
    test_batch_fills_match_the_general_path(seed)
    batch_idx, general_idx, _, _, _ = _history(seed)
    rng = random.Random(500 + seed)
    keys = [_key(rng) for _ in range(20)]
    slots = batch_idx.allocate_slots(20)
    general_idx.allocate_slots(20)
    batch_idx.begin_host_fills(keys, slots, parents=[None, *keys[:-1]])
    with general_idx._lock:
        for key, slot, parent in zip(keys, slots, [None, *keys[:-1]], strict=True):
            general_idx.fills._begin_fill(key, slot, parent, True)
    assert _state(batch_idx) == _state(general_idx)
