"""The object tier's presence hints are capped (`object_store_hint_cap`, tiers/object/hints.py):
past the cap the oldest hints are forgotten and the index clears their `Tier.OBJECT` bits; the
blocks stay in the bucket and a new lookup finds them again. In-process engines over a
`file://` bucket (tests/unit/coordinator/test_object_wiring.py's helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.coordinator_util import _engine, _keys, _ns, _pages

from flexkv_py.config import load_config
from flexkv_py.errors import ConfigError
from flexkv_py.index import Tier
from flexkv_py.tiers.object.hints import ObjectHints
from unit.coordinator.test_object_wiring import (
    SLOTS,
    _bucket_with,
    _object_config,
    _stored_to_bucket,
)


def test_hints_forget_the_oldest_past_the_cap() -> None:
    hints = ObjectHints(4)
    assert hints.learned([b"a", b"b", b"c"]) == []
    assert hints.learned([b"a"]) == []  # learned again: newest now
    assert hints.learned([b"d", b"e"]) == [b"b"]  # the oldest goes, not the re-learned a
    assert len(hints) == 4 and b"a" in hints and b"b" not in hints
    hints.forget([b"c"])
    assert len(hints) == 3 and hints.forgotten == 1
    # A large cap forgets an eighth of it at once (one scan per batch).
    big = ObjectHints(64)
    big.learned(bytes([i]) for i in range(64))
    assert big.learned([b"new"]) == [bytes([i]) for i in range(8)]
    assert len(big) == 57
    assert ObjectHints(0).learned([b"x"]) == [b"x"]  # 0: no hint kept


def test_a_negative_cap_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="object_store_hint_cap"):
        load_config(
            {"cpu_cache_gb": 0.01, "object_store_url": "memory://", "object_store_hint_cap": -1},
            env={},
        )


def test_lookup_hints_past_the_cap_are_forgotten_and_found_again(tmp_path: Path) -> None:
    ns = _ns()
    bucket, keys, pages = _bucket_with(tmp_path, 10)
    cfg = _object_config(tmp_path / "b", bucket, object_store_hint_cap=4)
    with _engine(cfg, ns, SLOTS) as b:
        assert b.lookup_object(keys) == 10
        stats = b.stats()["manager"]
        assert stats["object_hints"] == 4 and stats["object_hints_forgotten"] == 6
        index = b.manager.index
        assert [index.readable_on(k, Tier.OBJECT) for k in keys] == [False] * 6 + [True] * 4
        assert b.lookup(keys) == 0  # the chain's root is no longer known to be in the bucket
        assert b.lookup_object(keys[:3]) == 3  # still there: asked again, learned again
        assert b.lookup(keys) == 3 and b.load_pages(keys[:3]) == pages[:3]
        assert b.stats()["manager"]["object_hints"] == 4


def test_write_behind_hints_are_capped_too(tmp_path: Path) -> None:
    ns = _ns()
    keys = _keys(ns, 10)
    pages = _pages(keys)
    cfg = _object_config(tmp_path / "a", tmp_path / "bucket", object_store_hint_cap=3)
    with _engine(cfg, ns, SLOTS) as a:
        _stored_to_bucket(a, keys, pages)
        stats = a.stats()["manager"]
        assert stats["object_hints"] == 3 and stats["object_hints_forgotten"] == 7
        index = a.manager.index
        assert sum(index.readable_on(k, Tier.OBJECT) for k in keys) == 3
        assert a.lookup(keys) == 10 and a.load_pages(keys) == pages  # host copies untouched
