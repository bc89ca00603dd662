"""The staged path's H2D chunk plan (transfer/staged_path.py h2d_chunks): whole chunks, then the
last one cut in halves down to the tail size, every page once, in order."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("triton")  # staged_path imports the Triton path

from flexkv_py.transfer.staged_path import h2d_chunks


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 31, 32, 33, 64, 100, 256, 2048])
@pytest.mark.parametrize(("chunk", "tail"), [(32, 8), (4, 4), (4, 1), (1, 1), (32, 32)])
def test_chunks_cover_the_batch_in_order(n: int, chunk: int, tail: int) -> None:
    chunks = h2d_chunks(n, chunk, tail)
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sizes = [end - start for start, end in chunks]
    assert all(0 < k <= chunk for k in sizes)


def test_the_last_chunk_tapers_to_the_tail() -> None:
    assert [e - s for s, e in h2d_chunks(256, 32, 8)] == [32] * 7 + [16, 8, 8]
    assert [e - s for s, e in h2d_chunks(64, 32, 8)] == [32, 16, 8, 8]
    assert [e - s for s, e in h2d_chunks(8, 32, 8)] == [8]
    assert [e - s for s, e in h2d_chunks(100, 32, 32)] == [32, 32, 32, 4]
