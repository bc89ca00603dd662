"""The capacity the index sizes the SSD tier by is what a real store holds: fill one to it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.store_util import block

from flexkv_py._native import BlockStore, ConfigError
from flexkv_py.index.lower_capacity import STORE_PAGE, SUPERBLOCK_PAGES, block_pages
from flexkv_py.index.lower_capacity import store_capacity_blocks as capacity


def test_the_layout_counts_header_pages_and_the_superblock() -> None:
    assert block_pages(1) == 2 and block_pages(STORE_PAGE) == 2 and block_pages(STORE_PAGE + 1) == 3
    assert SUPERBLOCK_PAGES == 1
    assert capacity(10 * 2 * STORE_PAGE, 1, STORE_PAGE) == 9
    assert capacity(2 * (5 * 2 + 1) * STORE_PAGE, 2, STORE_PAGE) == 10
    with pytest.raises(ConfigError):
        capacity(1 << 20, 0, STORE_PAGE)
    with pytest.raises(ValueError):
        capacity(1 << 20, 1, 0)


@pytest.mark.parametrize(
    ("dirs", "size", "budget"),
    [
        (1, STORE_PAGE, 40 * STORE_PAGE + 123),
        (1, 3 * STORE_PAGE + 1, 64 * STORE_PAGE),
        (2, 5000, 2 * 37 * STORE_PAGE + STORE_PAGE // 2),
        (3, 2 * STORE_PAGE, 100 * STORE_PAGE),
    ],
)
def test_a_store_holds_exactly_the_capacity(
    tmp_path: Path, dirs: int, size: int, budget: int
) -> None:
    paths = [tmp_path / f"d{i}" for i in range(dirs)]
    for p in paths:
        p.mkdir()
    n = capacity(budget, dirs, size)
    assert n > 0
    with BlockStore([str(p) for p in paths], budget, preallocate=False) as store:
        for i in range(n):
            key = b"k%d" % i
            assert store.put(key, block(key, size)).status == "ok"
        # Every block is still there: the store had room for all of them.
        assert len(store) == n and store.drain_evicted() == []
        # One more does not fit without evicting one.
        assert store.put(b"extra", block(b"extra", size)).status == "ok"
        assert len(store.drain_evicted()) == 1 and len(store) == n
