"""The manager's KV event queue (coordinator/kv_events.py): batches become the same events, in
order, as one-by-one events; at most `maxlen` are held, the oldest dropped first."""

from __future__ import annotations

import pytest
from helpers.coordinator_util import _keys, _ns

from flexkv_py.coordinator.kv_events import EventQueue, KVEvent
from flexkv_py.index.namespace import PREFIX_LEN
from flexkv_py.index.tier_names import Tier


def test_batches_keep_order_and_drop_the_oldest_past_maxlen() -> None:
    ns = _ns()
    keys = _keys(ns, 10, b"q")
    q = EventQueue(ns, maxlen=6)
    q.add("stored", keys[:4], Tier.HOST)
    q.add("removed", keys[4:5], Tier.SSD)
    q.add("stored", keys[5:6], Tier.NODE)  # a sibling's block: not announced here
    assert len(q) == 5
    q.add("stored", keys[5:8], Tier.SSD)  # 8 events: the 2 oldest go
    assert len(q) == 6
    got = q.take()
    want = [KVEvent("stored", ns.block_hash(k), "CPU") for k in keys[2:4]]
    want += [KVEvent("removed", ns.block_hash(keys[4]), "SSD")]
    want += [KVEvent("stored", ns.block_hash(k), "SSD") for k in keys[5:8]]
    assert got == want
    assert [e.group_prefix for e in got] == [k[:PREFIX_LEN] for k in keys[2:8]]
    assert len(q) == 0 and q.take() == []
    q.add("stored", keys[:3], Tier.HOST)
    q.add("stored", keys[3:10], Tier.HOST)  # one batch past maxlen: its own oldest go too
    assert q.take() == [KVEvent("stored", ns.block_hash(k), "CPU") for k in keys[4:10]]


def test_a_foreign_key_queues_nothing() -> None:
    ns = _ns()
    q = EventQueue(ns, maxlen=4)
    with pytest.raises(ValueError, match="namespace"):
        q.add("stored", [*_keys(ns, 2, b"f"), b"x" * 64], Tier.HOST)
    with pytest.raises(ValueError, match="namespace"):
        q.add("stored", [next(iter(ns.prefixes))], Tier.HOST)  # too short for a hash
    assert len(q) == 0 and q.take() == []
