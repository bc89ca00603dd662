"""Copies that continue one another become one (transfer/copy_engine_path.py `coalesce`): the
staged path's page copies of consecutive host slots go to the driver as one descriptor. The
merged list must move exactly the same bytes, in the same order."""

from __future__ import annotations

import numpy as np
import pytest

from flexkv_py.transfer.copy_engine_path import coalesce

PAGE = 4096


def _bytes_moved(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    """Every (dst byte, src byte) pair the copies move, page-granular (PAGE-sized steps)."""
    out = []
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        out.extend((d + o, s + o) for o in range(0, n, PAGE))
    return out


def _pages(slots: list[int], base: int = 1 << 40) -> tuple[np.ndarray, ...]:
    """Copies of host slots `slots` into consecutive staging rows, as the staged path builds."""
    k = len(slots)
    stage = np.uint64(1 << 32) + np.arange(k, dtype=np.uint64) * np.uint64(PAGE)
    host = np.uint64(base) + np.asarray(slots, dtype=np.uint64) * np.uint64(PAGE)
    return stage, host, np.full(k, PAGE, dtype=np.uint64)


@pytest.mark.parametrize(
    ("slots", "runs"),
    [
        (list(range(32)), 1),  # blocks stored together: one copy
        ([5, 6, 7, 20, 21, 3], 3),  # runs broken where the slots jump
        ([9, 8, 7, 6], 4),  # descending slots never merge (the bytes would land reversed)
        ([4], 1),
        ([0, 2, 4, 6], 4),
    ],
)
def test_runs_of_consecutive_pages_merge(slots: list[int], runs: int) -> None:
    stage, host, sizes = _pages(slots)
    d, s, n = coalesce(stage, host, sizes)
    assert len(n) == runs
    assert int(n.sum()) == len(slots) * PAGE
    assert _bytes_moved(d, s, n) == _bytes_moved(stage, host, sizes)


def test_both_ends_must_continue() -> None:
    """Consecutive sources into destinations that jump stay apart (and the reverse)."""
    stage, host, sizes = _pages([0, 1, 2, 3])
    stage[2:] += np.uint64(PAGE)  # destination gap before the third copy
    d, s, n = coalesce(stage, host, sizes)
    assert n.tolist() == [2 * PAGE, 2 * PAGE]
    assert _bytes_moved(d, s, n) == _bytes_moved(stage, host, sizes)
    stage, host, sizes = _pages([0, 1, 3, 4])  # source gap, destinations consecutive
    d, s, n = coalesce(stage, host, sizes)
    assert n.tolist() == [2 * PAGE, 2 * PAGE]


def test_nothing_to_merge_returns_the_arrays_themselves() -> None:
    stage, host, sizes = _pages([3, 1])
    d, s, n = coalesce(stage, host, sizes)
    assert d is stage and s is host and n is sizes
