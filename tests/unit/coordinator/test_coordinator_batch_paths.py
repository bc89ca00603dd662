"""The batch fast paths of the coordinator's hot loops (benches/coordinator_bench.py): each must
give exactly what the per-block path gives."""

from __future__ import annotations

import dataclasses

import pytest

from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheManager, KVEvent
from flexkv_py.index import Namespace, Tier
from flexkv_py.index.entry import Located
from flexkv_py.index.namespace import PREFIX_LEN
from flexkv_py.index.tier_index import TierIndex

NS_FIELDS = {"model": "test/batch-paths", "kv_dtype": "bfloat16", "kv_layout": "LBNHC"}


def _ns() -> Namespace:
    return Namespace(revision=None, block_size=16, page_bytes=4096, **NS_FIELDS)


def _keys(ns: Namespace, n: int, tag: bytes) -> list[bytes]:
    return ns.keys([tag + b"-%028d" % i for i in range(n)])


def test_known_many_answers_as_known_for_warm_cold_pending_and_unknown_keys() -> None:
    ns = _ns()
    idx = TierIndex(8)
    warm, cold, filling, unknown = (_keys(ns, 3, t) for t in (b"w", b"c", b"f", b"u"))
    slots = idx.allocate_slots(6)
    idx.begin_host_fills(warm, slots[:3])
    idx.commit_host_fills(warm, [True] * 3)
    idx.begin_host_fills(filling, slots[3:])  # in flight: known, not readable
    idx.set_present(cold, Tier.SSD, True)  # no entry: in the cold sets only
    mixed = [warm[0], unknown[0], cold[1], filling[2], unknown[2], cold[0], warm[2]]
    assert idx.known_many(mixed) == [idx.known(k) for k in mixed]
    assert idx.known_many(mixed) == [True, False, True, True, False, True, True]
    assert idx.known_many([]) == []


def test_acquire_locates_host_and_lower_blocks_and_stops_at_the_first_miss() -> None:
    ns = _ns()
    idx = TierIndex(8)
    host, cold, missing = _keys(ns, 2, b"h"), _keys(ns, 2, b"c"), _keys(ns, 1, b"m")
    slots = idx.allocate_slots(2)
    idx.begin_host_fills(host, slots)
    idx.commit_host_fills(host, [True, True])
    idx.set_present(cold, Tier.SSD, True)
    got = idx.acquire([host[1], cold[0], host[0], *missing, cold[1]], count_hits=True)
    assert got == [
        Located(Tier.HOST, slots[1]),
        Located(Tier.SSD, None),
        Located(Tier.HOST, slots[0]),
    ]
    assert all(type(loc) is Located for loc in got)  # a real Located, its fields by name
    assert got[0].tier is Tier.HOST and got[0].host_slot == slots[1]
    for key in (host[1], cold[0], host[0]):
        entry = idx.entry(key)
        assert entry is not None and entry.pins == 1 and entry.hits >= 1
    assert idx.entry(cold[1]) is not None and idx.entry(cold[1]).pins == 0  # after the miss
    idx.unpin([host[1], cold[0], host[0]])
    assert idx.host_slot_of(host[0]) == slots[0]


def test_a_batch_of_events_is_the_same_frozen_events_as_one_by_one() -> None:
    ns = _ns()
    cfg = load_config({"cpu_cache_gb": 16 * 4096 / 2**30}, env={})
    mgr = CacheManager(cfg, ns, page_bytes=4096, num_host_slots=16)
    keys = _keys(ns, 4, b"e")
    for key in keys:
        mgr.events.add("stored", (key,), Tier.HOST)
    one_by_one = mgr.take_events()
    mgr.events.add("stored", keys, Tier.HOST)
    batch = mgr.take_events()
    assert batch == one_by_one
    assert [hash(e) for e in batch] == [hash(e) for e in one_by_one]
    assert [repr(e) for e in batch] == [repr(e) for e in one_by_one]
    assert [e.group_prefix for e in batch] == [k[:PREFIX_LEN] for k in keys]
    assert batch[0] == KVEvent("stored", ns.block_hash(keys[0]), "CPU")
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch[0].kind = "removed"  # type: ignore[misc]
    with pytest.raises(ValueError, match="namespace"):
        mgr.events.add("stored", [b"x" * 64], Tier.HOST)  # not a key of this namespace
