"""The staged path's plan of a batch, on CPU: its chunks (tapered at the end no DMA hides) and
its merged page copies (consecutive slots, never across a pinned registration)."""

from __future__ import annotations

import numpy as np
import pytest

from flexkv_py.transfer.staged_path import chunk_bounds, merged_runs


def sizes(bounds: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in bounds]


@pytest.mark.parametrize("n", [0, 1, 2, 5, 31, 63, 64, 70, 2048])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("taper", [True, False])
def test_chunks_cover_the_batch_in_order_and_fit_the_staging_buffer(
    n: int, direction: str, taper: bool
) -> None:
    bounds = chunk_bounds(n, 32, direction, taper=taper)
    starts = [start for start, _ in bounds]
    assert starts == [0, *[end for _, end in bounds[:-1]]][: len(bounds)]
    assert sum(sizes(bounds)) == n
    assert all(1 <= size <= 32 for size in sizes(bounds))


def test_a_d2h_starts_small_and_an_h2d_ends_small() -> None:
    assert sizes(chunk_bounds(70, 32, "d2h")) == [1, 2, 4, 8, 16, 32, 7]
    assert sizes(chunk_bounds(70, 32, "h2d")) == [7, 32, 16, 8, 4, 2, 1]
    assert sizes(chunk_bounds(5, 32, "d2h")) == [1, 2, 2]
    # Untapered: full chunks, the remainder last (the path as it was).
    assert sizes(chunk_bounds(70, 32, "h2d", taper=False)) == [32, 32, 6]
    assert sizes(chunk_bounds(70, 1, "d2h")) == [1] * 70


def test_consecutive_slots_merge_until_a_registration_boundary() -> None:
    slots = np.array([4, 5, 6, 7, 8, 2, 3, 9, 10, 12])
    firsts, lengths = merged_runs(slots, span=6)
    # 4-5 (6 starts the next registration), 6-8, 2-3, 9-10, 12
    assert list(zip(firsts.tolist(), lengths.tolist(), strict=True)) == [
        (0, 2),
        (2, 3),
        (5, 2),
        (7, 2),
        (9, 1),
    ]
    assert lengths.sum() == len(slots)


def test_span_one_or_descending_slots_merge_nothing() -> None:
    assert merged_runs(np.arange(8), span=1)[1].tolist() == [1] * 8
    assert merged_runs(np.arange(8)[::-1].copy(), span=64)[1].tolist() == [1] * 8
    firsts, lengths = merged_runs(np.zeros(0, dtype=np.int64), span=4)
    assert len(firsts) == 0 and len(lengths) == 0
