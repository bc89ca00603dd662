"""The scheduler's own read of an engine's SSD shards at a restart (tiers/ssd/inventory.py), the
thread it runs on (integration/vllm/restart_read.py) and how the workers' reports settle what
it adopted (coordinator/adopted_before.py). Shards are written by the worker's real SSD tier;
no engine here."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers.coordinator_util import PAGE_BYTES, _keys, _ns
from helpers.store_util import block

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.coordinator import CacheManager
from flexkv_py.coordinator.adopted_before import AdoptedBefore
from flexkv_py.index import Namespace, Tier
from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.joined_keys import JoinedKeys, JoinedLinks
from flexkv_py.integration.vllm.restart_read import RestartRead
from flexkv_py.tiers.ssd import inventory as ssd_inventory
from flexkv_py.tiers.ssd.inventory import read_ssd_inventory, shard_dirs
from flexkv_py.tiers.ssd.tier import SsdTier

GIB = 1 << 30


def _config(*dirs: Path) -> FlexKVConfig:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return load_config(
        {
            "cpu_cache_gb": 64 * PAGE_BYTES / GIB,
            "ssd_cache_gb": 0.02,
            "ssd_cache_dir": ";".join(map(str, dirs)),
        },
        env={},
    )


def _write(config: FlexKVConfig, ns: Namespace, keys: list[bytes], chain: bool = True) -> None:
    """What one worker rank's SSD tier stores: `keys` as one chain (or unlinked)."""
    tier = SsdTier(config, ns)
    parents = [keys[i - 1] if i and chain else None for i in range(len(keys))]
    results = tier.submit_put([(k, block(k, PAGE_BYTES)) for k in keys], parents=parents).wait(30)
    assert all(r.ok for r in results)
    tier.close()


def test_every_shard_of_the_engine_and_only_what_all_of_them_hold(tmp_path: Path) -> None:
    """TP 2 x PP 2 over two striped directories: a block one rank lacks is not listed, nor
    another namespace's block in the same shards, nor what a sibling engine's shards hold."""
    config = _config(tmp_path / "a", tmp_path / "b")
    ns = _ns(tp_size=2, pp_size=2, engine_id=0, node_engines=2)
    keys = _keys(ns, 10)
    for tp, pp in [(0, 0), (1, 0), (0, 1), (1, 1)]:
        held = keys if (tp, pp) != (1, 1) else keys[:4] + keys[5:]  # rank (1, 1) lost block 4
        _write(config, ns.for_rank(tp, pp), held)
    other = _ns("other/model", tp_size=2, pp_size=2, engine_id=0, node_engines=2)
    _write(config, other.for_rank(0, 0), _keys(other, 3))  # same shard, other namespace
    sibling = replace(ns, engine_id=1)
    _write(config, sibling.for_rank(0, 0), _keys(ns, 3, "sibling-"))

    assert [dirs for _, dirs in shard_dirs(config, ns)][:2] == [
        [str(tmp_path / "a" / "engine0-tp0-pp0"), str(tmp_path / "b" / "engine0-tp0-pp0")],
        [str(tmp_path / "a" / "engine0-tp1-pp0"), str(tmp_path / "b" / "engine0-tp1-pp0")],
    ]
    inv = read_ssd_inventory(config, ns)
    assert inv is not None and inv.shards == 4
    assert inv.keys == keys[:4] + keys[5:]  # rank (0, 0)'s order: oldest first
    assert isinstance(inv.keys, JoinedKeys)  # intersected as buffers: no object per block
    assert inv.parents == {}  # the workers' reports bring the chain links


def test_chain_links_are_read_when_the_index_must_evict_at_adoption(tmp_path: Path) -> None:
    config = _config(tmp_path / "ssd")
    ns = _ns()
    keys = _keys(ns, 6)
    _write(config, ns, keys)
    other = _ns("other/model")
    _write(config, other, _keys(other, 2))  # linked, not of this namespace
    links = {keys[i]: keys[i - 1] for i in range(1, 6)}
    for parents_over, expected in [(None, {}), (8, {}), (7, links)]:  # 8 blocks in the shard
        inv = read_ssd_inventory(config, ns, parents_over)
        assert inv is not None and inv.keys == keys and inv.parents == expected
        assert isinstance(inv.keys, JoinedKeys)  # one width: no object per block
        assert isinstance(inv.parents, JoinedLinks) == bool(expected)


def test_replicated_kv_reads_tp_rank_0s_shard_once(tmp_path: Path) -> None:
    config = _config(tmp_path / "ssd")
    ns = _ns(tp_size=2, kv_replicated=True)
    keys = _keys(ns, 5)
    _write(config, ns.for_rank(0, 0), keys)  # MLA: rank 0 alone writes
    inv = read_ssd_inventory(config, ns)
    assert inv is not None and inv.shards == 1 and inv.keys == keys


def test_a_first_start_reads_nothing(tmp_path: Path) -> None:
    ns = _ns(tp_size=2)
    config = _config(tmp_path / "ssd")
    _write(config, ns.for_rank(0, 0), _keys(ns, 3))  # rank 1's shard was never written
    for cfg in (_config(tmp_path / "empty"), config):
        inv = read_ssd_inventory(cfg, ns)
        assert inv is not None and inv.keys == [] and inv.parents == {}


def test_a_shard_in_use_by_its_writer_is_read(tmp_path: Path) -> None:
    """vLLM builds the scheduler after the workers opened (and locked) their shards."""
    config = _config(tmp_path / "ssd")
    ns = _ns()
    keys = _keys(ns, 4)
    _write(config, ns, keys[:2])
    writer = SsdTier(config, ns)  # holds the shard's lock, as a running worker does
    try:
        assert all(
            r.ok for r in writer.submit_put([(k, block(k, PAGE_BYTES)) for k in keys[2:]]).wait(30)
        )
        inv = read_ssd_inventory(config, ns)
        assert inv is not None and inv.keys == keys
    finally:
        writer.close()


@pytest.mark.parametrize("damage", ["garbage-journal", "journal-is-a-directory", "no-data-file"])
def test_an_unreadable_shard_reads_as_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """None: the scheduler then waits for the workers' reports, as before (never raises)."""
    config = _config(tmp_path / "a", tmp_path / "b")
    ns = _ns()
    _write(config, ns, _keys(ns, 4))
    journal = tmp_path / "a" / ns.shard_dir_name / ssd_inventory.JOURNAL_FILE
    if damage == "garbage-journal":
        journal.write_bytes(b"\xff" * 64 + journal.read_bytes()[64:])
    elif damage == "journal-is-a-directory":
        journal.unlink()
        journal.mkdir()
    else:  # a replaced disk: the writer starts that stripe over, a read-only view cannot
        (tmp_path / "b" / ns.shard_dir_name / "flexkv-blocks.dat").unlink()
    with caplog.at_level(logging.WARNING, logger=ssd_inventory.__name__):
        assert read_ssd_inventory(config, ns) is None
    assert "not readable before the workers report" in caplog.text


def test_an_open_that_raises_reads_as_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path / "ssd")
    ns = _ns()
    _write(config, ns, _keys(ns, 2))

    def failing(*args: Any, **kw: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ssd_inventory._native, "BlockStore", failing)
    assert read_ssd_inventory(config, ns) is None


# ---------------------------------------------------------------- the reports settle it
def _manager(tmp_path: Path) -> CacheManager:
    return CacheManager(_config(tmp_path / "ssd"), _ns(), PAGE_BYTES, num_host_slots=4)


def test_the_reports_settle_what_was_adopted_before(tmp_path: Path) -> None:
    """Adopted early: a b c d. The reports (2 ranks) list a b d e on both and c on one: c
    leaves the index (and is deleted where it is left), e is adopted, nothing is counted or
    announced twice."""
    mgr = _manager(tmp_path)
    a, b, c, d, e = _keys(mgr.namespace, 5)
    assert mgr.adopt_ssd_keys([[a, b, c, d]], parents={b: a}) == 4
    before = AdoptedBefore([a, b, c, d])
    mgr.take_events()
    assert (
        mgr.adopt_ssd_keys([[a, b, c, d, e], [a, b, d, e]], parents={b: a, e: d}, before=before)
        == 1
    )
    assert [mgr.index.readable_on(k, Tier.SSD) for k in (a, b, c, d, e)] == [1, 1, 0, 1, 1]
    stats = mgr.stats()
    assert stats["ssd_adopted_blocks"] == 5 and stats["ssd_forgotten_blocks"] == 1
    events = [(ev.kind, ev.block_hash) for ev in mgr.take_events()]
    assert events == [("removed", c[HEAD_LEN:]), ("stored", e[HEAD_LEN:])]
    drops = [k for job in mgr.take_jobs() for k in getattr(job, "keys", ())]
    assert drops == [c]  # an orphan: rank 0 still holds it
    assert mgr.index.kids(a) == 1 and mgr.index.kids(d) == 1  # e linked; a's link not doubled
    assert len(before) == 0  # settled once, then forgotten


def test_a_block_evicted_before_the_reports_is_not_adopted_again(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    keys = _keys(mgr.namespace, 3)
    mgr.adopt_ssd_keys([keys])
    before = AdoptedBefore(keys)
    mgr.index.set_present([keys[0]], Tier.SSD, False)  # the scheduler evicted it meanwhile
    assert mgr.adopt_ssd_keys([keys], before=before) == 0  # the reports' snapshot still lists it
    assert not mgr.index.readable_on(keys[0], Tier.SSD)
    assert mgr.stats()["ssd_adopted_blocks"] == 3


def test_a_worker_without_ssd_takes_everything_adopted_before_away(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    keys = _keys(mgr.namespace, 6)
    mgr.adopt_ssd_keys([keys])
    assert mgr.adopt_ssd_keys([keys, []], before=AdoptedBefore(keys)) == 0
    assert mgr.index.readable_prefix(keys) == 0
    assert mgr.index.counts()["on_ssd"] == 0


@pytest.mark.parametrize("mixed", [False, True])
def test_what_was_adopted_before_settles_the_same_packed_or_not(mixed: bool) -> None:
    """Keys of one length are kept joined (no object per block until the settle); keys of
    mixed lengths as their list. Either way the settle answers (new, gone), in order, once."""
    keys = [bytes([i]) * (40 + (i % 2 if mixed else 0)) for i in range(6)]
    same = AdoptedBefore(keys)
    assert len(same) == 6 and same.settle(tuple(keys)) == ([], []) and len(same) == 0
    assert same.settle(tuple(keys)) == (list(keys), [])  # forgotten after the first settle
    reported = [keys[0], keys[2], keys[3], keys[5], b"\xff" * 40]
    before = AdoptedBefore(keys)
    new, gone = before.settle(reported)
    assert (new, gone) == ([b"\xff" * 40], [keys[1], keys[4]])
    # One width: the difference is found on the buffers and comes joined.
    assert isinstance(new, JoinedKeys) == isinstance(gone, JoinedKeys) == (not mixed)
    # Same count and same joined bytes, split differently: not the same keys.
    tricky = AdoptedBefore([b"ab", b"cd"])
    assert tricky.settle([b"a", b"bcd"]) == ([b"a", b"bcd"], [b"ab", b"cd"])


# ---------------------------------------------------------------- the read's thread
def test_the_first_wait_returns_once_the_read_is_adopted() -> None:
    release = threading.Event()
    adopted: list[str] = []
    read = RestartRead(lambda: release.wait(30) and "inventory", adopted.append)
    release.set()
    read.wait()
    assert adopted == ["inventory"] and read.adopted and read.done


def test_a_read_slower_than_the_wait_is_never_adopted(caplog: pytest.LogCaptureFixture) -> None:
    """The wait is bounded: after it the blocks miss until the workers report, and a read that
    ends later must not change the index under the reports."""
    release = threading.Event()
    adopted: list[str] = []
    read = RestartRead(lambda: release.wait(30) and "late", adopted.append)
    with caplog.at_level(logging.WARNING):
        read.wait(timeout=0.2)
    assert read.done and not read.adopted and "not read in 0.2 s" in caplog.text
    release.set()
    read._thread.join(30)
    assert not read._thread.is_alive() and adopted == []


@pytest.mark.parametrize("fails", ["read", "adopt"])
def test_a_failing_read_or_adoption_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture, fails: str
) -> None:
    def boom(*args: Any) -> Any:
        raise RuntimeError("boom")

    read = RestartRead(boom if fails == "read" else lambda: "x", boom)
    with caplog.at_level(logging.ERROR):
        read.wait()
    assert read.done and not read.adopted and "boom" in caplog.text
