"""A restart's listing without an object per block: keys joined in one buffer (JoinedKeys), listed
so by the store (`BlockStore.keys_joined`) and adopted so by the cold sets
(`BlockSet.add_joined`), with the same answers as the keys one by one."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from helpers.coordinator_util import PAGE_BYTES, _keys, _ns
from helpers.store_util import block

from flexkv_py._native import BlockSet, BlockStore
from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheManager
from flexkv_py.coordinator.adopted_before import AdoptedBefore
from flexkv_py.index import Tier
from flexkv_py.index.joined_keys import JoinedKeys, JoinedLinks
from flexkv_py.integration.vllm.metadata import FlexKVWorkerMetadata
from flexkv_py.integration.vllm.restart_inventory import RestartInventory
from flexkv_py.tiers.ssd.inventory import read_ssd_inventory
from flexkv_py.tiers.ssd.tier import SsdTier


def test_joined_keys_read_as_the_keys_they_join() -> None:
    keys = [bytes([i]) * 5 for i in range(4)]
    joined = JoinedKeys.of(keys)
    assert joined is not None and joined.width == 5 and len(joined) == 4
    assert list(joined) == keys and joined == keys and joined[-1] == keys[3]
    assert joined[1:3] == keys[1:3] and joined != keys[:3] and joined != [*keys[:3], b"x" * 5]
    with pytest.raises(IndexError):
        joined[4]
    assert JoinedKeys.of([b"ab", b"c"]) is None and JoinedKeys.of([]) is None
    with pytest.raises(ValueError, match="whole keys"):
        JoinedKeys(b"abc", 2)


def test_a_set_adopts_joined_keys_as_it_adopts_them_one_by_one() -> None:
    keys = [bytes([i % 251, i // 251]) * 30 for i in range(1000)]
    one, joined = BlockSet(chains=True), BlockSet(chains=True)
    assert one.add_keys(keys) == joined.add_joined(b"".join(keys), 60) == 1000
    assert sorted(one.digests()) == sorted(joined.digests())
    assert joined.add_joined(b"".join(keys[:10]), 60) == 0  # present already
    assert keys[7] in joined and b"z" * 60 not in joined
    with pytest.raises(ValueError, match="width"):
        joined.add_joined(b"x" * 61, 60)
    with pytest.raises(ValueError, match="width"):
        joined.add_joined(b"", 0)


def test_the_store_lists_the_keys_of_its_heads_joined_tag_cut(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    with BlockStore(str(tmp_path / "s"), 1 << 24, preallocate=False) as store:
        wanted = [b"TAGhead" + bytes([i]) * 8 for i in range(5)]
        other = [b"TAGelse" + bytes([i]) * 8 for i in range(2)] + [b"TAGhead"]
        for k in [wanted[0], other[0], *wanted[1:], *other[1:]]:
            assert store.put(k, block(k, 4096)).ok
        got = store.keys_joined([b"TAGhead"], 3, 9)
        assert got is not None
        joined, width = got
        assert width == 12 and JoinedKeys(joined, width) == [k[3:] for k in wanted]
        assert store.keys_joined([b"none"], 3, 9) == (b"", 0)
        assert store.put(b"TAGhead" + b"longer" * 3, block(b"x", 4096)).ok
        assert store.keys_joined([b"TAGhead"], 3, 9) is None  # widths differ: keys() then


def test_the_read_of_a_shard_comes_joined_and_is_adopted_and_settled(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    config = load_config(
        {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.02, "ssd_cache_dir": str(d)}, env={}
    )
    ns = _ns()
    keys = _keys(ns, 40)
    rank = ns.for_rank(0, 0)
    tier = SsdTier(config, rank)
    assert all(r.ok for r in tier.submit_put([(k, block(k, PAGE_BYTES)) for k in keys]).wait(30))
    tier.close()
    inv = read_ssd_inventory(config, ns)
    assert inv is not None and isinstance(inv.keys, JoinedKeys) and inv.keys == keys
    mgr = CacheManager(config, ns, PAGE_BYTES, num_host_slots=4)
    assert mgr.adopt_ssd_keys([inv.keys], checked=True) == 40
    assert mgr.index.readable_prefix(keys) == 40
    before = AdoptedBefore(inv.keys)
    # The reports list all but the last, and one new block: the settle's difference.
    new = _keys(ns, 41)[40]
    assert mgr.adopt_ssd_keys([[*keys[:-1], new]], before=before) == 1
    assert [mgr.index.readable_on(k, Tier.SSD) for k in (keys[-1], new)] == [0, 1]


def test_the_restart_report_comes_joined_and_says_what_inventory_says(tmp_path: Path) -> None:
    """SsdTier.restart_report (what worker (0, 0) sends): the keys and child -> parent links of
    `inventory()`, as joined buffers; pickled as the worker metadata is; linked from the
    buffers into a fresh index, with the links the dict would make."""
    d = tmp_path / "ssd"
    d.mkdir()
    config = load_config(
        {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.02, "ssd_cache_dir": str(d)}, env={}
    )
    ns = _ns()
    keys = _keys(ns, 12)
    tier = SsdTier(config, ns.for_rank(0, 0))
    parents = [keys[i - 1] if i % 4 else None for i in range(12)]  # chains of 4
    items = [(k, block(k, PAGE_BYTES)) for k in keys]
    assert all(r.ok for r in tier.submit_put(items, parents=parents).wait(30))
    got_keys, links = tier.restart_report()
    expected = tier.inventory()
    tier.close()
    assert isinstance(got_keys, JoinedKeys) and isinstance(links, JoinedLinks)
    assert got_keys == [k for k, _ in expected] == keys
    assert dict(links.items()) == {k: p for k, p in expected if p is not None} and len(links) == 9
    sent_keys, sent_links = pickle.loads(pickle.dumps((got_keys, links)))
    assert sent_keys == keys and isinstance(sent_links, JoinedLinks)
    assert dict(sent_links.items()) == dict(links.items())
    joined, by_dict = (CacheManager(config, ns, PAGE_BYTES, num_host_slots=4) for _ in range(2))
    assert joined.adopt_ssd_keys([sent_keys], parents=sent_links) == 12
    assert by_dict.adopt_ssd_keys([keys], parents=dict(links.items())) == 12
    for mgr in (joined, by_dict):
        assert [mgr.index.kids(k) for k in keys[:4]] == [1, 1, 1, 0]


def test_the_other_workers_report_their_keys_joined(tmp_path: Path) -> None:
    """SsdTier.restart_keys (what workers other than (0, 0) send): `keys()` as one buffer,
    pickled as the worker metadata is; nothing stored reads as no keys."""
    d = tmp_path / "ssd"
    d.mkdir()
    config = load_config(
        {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.02, "ssd_cache_dir": str(d)}, env={}
    )
    ns = _ns(tp_size=2)
    keys = _keys(ns, 6)
    tier = SsdTier(config, ns.for_rank(1, 0))
    assert tier.restart_keys() == ()
    assert all(r.ok for r in tier.submit_put([(k, block(k, PAGE_BYTES)) for k in keys]).wait(30))
    got = tier.restart_keys()
    listed = tier.keys()
    tier.close()
    assert isinstance(got, JoinedKeys) and got == listed == keys
    assert pickle.loads(pickle.dumps(got)) == keys


def test_joined_links_refuse_children_without_parents() -> None:
    with pytest.raises(ValueError, match="as many parents"):
        JoinedLinks(JoinedKeys(b"ab" * 3, 2), JoinedKeys(b"ab" * 2, 2))
    s = BlockSet(chains=True)
    with pytest.raises(ValueError, match="whole keys"):
        s.link_joined(b"a" * 4, b"b" * 2, 2)
    assert s.add_joined(b"".join([b"p" * 30, b"c" * 30]), 30) == 2
    assert s.link_joined(b"c" * 30, b"p" * 30, 30) == 1 and s.kids_of(b"p" * 30) == 1
    assert s.link_joined(b"c" * 30, b"p" * 30, 30) == 0  # linked already


def test_a_joined_report_travels_the_metadata_and_settles_a_joined_read(tmp_path: Path) -> None:
    """The scheduler's read adopted the shard (joined); worker (0, 0)'s joined report, merged
    with another worker's empty metadata as vLLM aggregates them, settles it: nothing new,
    nothing gone, the chains linked from the buffers."""
    d = tmp_path / "ssd"
    d.mkdir()
    config = load_config(
        {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.02, "ssd_cache_dir": str(d)}, env={}
    )
    ns = _ns()
    keys = _keys(ns, 8)
    tier = SsdTier(config, ns.for_rank(0, 0))
    parents = [keys[i - 1] if i else None for i in range(8)]
    items = [(k, block(k, PAGE_BYTES)) for k in keys]
    assert all(r.ok for r in tier.submit_put(items, parents=parents).wait(30))
    report_keys, links = tier.restart_report()
    tier.close()
    mgr = CacheManager(config, ns, PAGE_BYTES, num_host_slots=4)
    inv = RestartInventory(1, enabled=True)
    inv.adopt_read(mgr, read_ssd_inventory(config, ns))
    assert inv.adopted_early == 8 and mgr.index.kids(keys[0]) == 0  # read without links
    mgr.take_events()
    meta = FlexKVWorkerMetadata(inventories={(0, 0): report_keys}, inventory_parents=links)
    merged = meta.aggregate(FlexKVWorkerMetadata()).aggregate(FlexKVWorkerMetadata())
    assert isinstance(merged, FlexKVWorkerMetadata)
    assert merged.inventory_parents is links and merged.inventories[(0, 0)] is report_keys
    sent = pickle.loads(pickle.dumps(merged))
    inv.adopt_reports(mgr, sent)
    assert inv.ready and mgr.stats()["ssd_adopted_blocks"] == 8
    assert mgr.stats()["ssd_forgotten_blocks"] == 0 and mgr.take_events() == []
    assert [mgr.index.kids(k) for k in keys] == [1] * 7 + [0]


def test_a_joined_report_with_a_foreign_key_is_filtered_as_a_list_is(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    config = load_config(
        {"cpu_cache_gb": 0.01, "ssd_cache_gb": 0.02, "ssd_cache_dir": str(d)}, env={}
    )
    ns, other = _ns(), _ns("other/model")
    keys, foreign = _keys(ns, 3), _keys(other, 1)
    assert ns.owns_all(JoinedKeys(b"".join(keys), len(keys[0])))
    mixed = JoinedKeys(b"".join([*keys[:2], *foreign, keys[2]]), len(keys[0]))
    assert not ns.owns_all(mixed) and ns.owns_all(JoinedKeys(b"", 0))
    mgr = CacheManager(config, ns, PAGE_BYTES, num_host_slots=4)
    assert mgr.adopt_ssd_keys([mixed]) == 3  # the foreign key left out, as from a list
    assert mgr.index.readable_prefix(keys) == 3 and not mgr.index.readable_on(foreign[0], Tier.SSD)
