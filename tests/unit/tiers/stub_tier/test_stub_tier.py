"""A lower tier added by its own package alone (the stub tier, spec.py): blocks leaving host
memory spill to it, the index keeps it within its capacity, its blocks load back bit-exact,
and its KV events name its medium, with no change to the manager, executor or events."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.index import Namespace
from flexkv_py.tiers import registry
from flexkv_py.tiers.host_pool import HostPool

from .spec import CAPACITY_BLOCKS, STUB, opened, registered

PAGE = 16384
HOST_SLOTS = 8
GIB = 1 << 30


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    with registered():
        config = load_config({"cpu_cache_gb": HOST_SLOTS * PAGE / GIB}, env={})
        ns = Namespace(
            "test/stub", revision="r1", kv_dtype="bfloat16", kv_layout="LBNHC",
            block_size=16, page_bytes=PAGE,
        )  # fmt: skip
        eng = CacheEngine(config, ns, HostPool(HOST_SLOTS, PAGE, pin=False))
        try:
            yield eng
        finally:
            eng.close()


def _keys(eng: CacheEngine, n: int) -> list[bytes]:
    return eng.manager.namespace.keys([f"stub-{i}".encode().ljust(32, b".") for i in range(n)])


def test_the_stub_tier_is_the_spill_tier_while_registered(engine: CacheEngine) -> None:
    assert engine.manager.spill_tier is STUB
    assert registry.spec_of(STUB).medium == "STUB"
    assert len(opened) == 1 and set(engine.executor.tiers) == {STUB}


def test_blocks_spill_to_it_within_its_capacity_and_load_back_bit_exact(
    engine: CacheEngine,
) -> None:
    n = HOST_SLOTS + CAPACITY_BLOCKS + 8  # more than host and stub hold together
    keys = _keys(engine, n)
    pages = [os.urandom(PAGE) for _ in keys]
    for i in range(0, n, 4):  # each store evicts older blocks from host: they spill
        assert engine.store_pages(keys[i : i + 4], pages[i : i + 4]).ok
    engine.flush()
    stub = opened[0]
    stats = engine.manager.stats()
    assert 0 < len(stub.blocks) <= CAPACITY_BLOCKS
    assert stats["spilled_blocks"] + stats["write_behind_blocks"] >= len(stub.blocks)
    assert stats["index_on_stub"] == len(stub.blocks)  # the index knows what the tier holds
    # Room was made by the index's choice (deletes sent to the tier), and a spill the tier had
    # no room for (the head of a chain stays while its blocks are cached) was refused.
    assert stats["stub_index_evicted_blocks"] == stub.deleted > 0
    got = engine.load_pages(keys)
    loaded = [i for i, page in enumerate(got) if page is not None]
    assert all(got[i] == pages[i] for i in loaded)  # never a wrong page
    from_stub = engine.manager.stats()["load_stub_blocks"]
    assert from_stub >= len(loaded) - HOST_SLOTS > 0


def test_its_kv_events_name_its_medium(engine: CacheEngine) -> None:
    keys = _keys(engine, HOST_SLOTS * 2)
    pages = [os.urandom(PAGE) for _ in keys]
    for i in range(0, len(keys), 4):
        assert engine.store_pages(keys[i : i + 4], pages[i : i + 4]).ok
    engine.flush()
    media = {(e.kind, e.medium) for e in engine.manager.take_events()}
    assert ("stored", "STUB") in media and ("stored", "CPU") in media


def test_unregistered_it_is_gone_and_a_second_registration_is_refused() -> None:
    with registered() as spec:
        with pytest.raises(ValueError, match="registered already"):
            registry.register(spec)
    assert all(s.tier is not STUB for s in registry.specs())
    config = load_config({"cpu_cache_gb": 1}, env={})
    assert registry.spill_spec(config) is None  # no SSD, no stub: blocks leaving host drop
