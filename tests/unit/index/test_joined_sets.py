"""The ranks' listings of a restart intersected and compared as joined buffers
(index/joined_sets.py): the same answers as the set code they replaced, joined results."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexkv_py.index import joined_sets
from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.joined_sets import common_and_orphans, common_keys, missing_from


def joined(keys: Sequence[bytes], width: int = 0) -> JoinedKeys:
    return JoinedKeys(b"".join(keys), width or len(keys[0]))


def by_sets(
    first: Sequence[bytes], others: Sequence[Sequence[bytes]]
) -> tuple[list[bytes], list[bytes]]:
    """What CacheManager.adopt_keys computed before: rank 0's order, orphans sorted once."""
    held = [set(o) for o in others]
    common = [k for k in first if all(k in h for h in held)]
    kept = set(common)
    return common, sorted({k for ks in (first, *others) for k in ks if k not in kept})


def test_common_keys_keep_the_first_ranks_order_and_orphans_come_sorted_once() -> None:
    a, b, c, d, e = (bytes([i]) * 6 for i in (5, 1, 4, 2, 3))
    common, orphans = common_and_orphans(joined([a, b, c, d]), [joined([e, d, b, a, e])])
    assert isinstance(common, JoinedKeys) and isinstance(orphans, JoinedKeys)
    assert list(common) == [a, b, d] and list(orphans) == [e, c]  # c: 0x04.., e: 0x03..
    assert common_keys(joined([a, b, c, d]), [joined([e, d, b, a])]) == [a, b, d]
    assert missing_from(joined([a, b, c, d]), joined([d, a])) == [b, c]


def test_duplicates_are_kept_in_common_and_listed_once_as_orphans() -> None:
    a, b, c = (bytes([i]) * 4 for i in (1, 2, 3))
    common, orphans = common_and_orphans(joined([a, b, a, c]), [joined([a, a]), joined([a, c])])
    assert list(common) == [a, a] and list(orphans) == [b, c]
    assert common_keys(joined([a, a]), [joined([a, a])]) == [a, a]  # the same buffers


def test_keys_ending_or_made_of_nul_bytes_are_kept_whole() -> None:
    """An `S` array element read as Python bytes loses its trailing NULs: results must not."""
    zero, tail, inner, high = (
        b"\x00" * 5,
        b"ab\x00\x00\x00",
        b"a\x00b\x00\x00",
        b"\xff\x00" * 2 + b"\x00",
    )
    first = joined([zero, tail, inner, high])
    common, orphans = common_and_orphans(first, [joined([high, inner, b"ab\x00\x00\x01"])])
    assert list(common) == [inner, high]
    assert list(orphans) == [zero, tail, b"ab\x00\x00\x01"]
    assert all(len(k) == 5 for k in (*common, *orphans))
    assert missing_from(first, joined([tail])) == [zero, inner, high]


def test_empty_listings_fit_any_width() -> None:
    keys = [bytes([i]) * 3 for i in range(3)]
    for empty in ([], (), JoinedKeys(b"", 0), JoinedKeys(b"", 7)):
        common, orphans = common_and_orphans(joined(keys), [empty])
        assert common == [] and isinstance(orphans, JoinedKeys) and list(orphans) == keys
        common, orphans = common_and_orphans(empty, [joined(keys)])
        assert common == [] and list(orphans) == keys
        assert isinstance(missing_from(joined(keys), empty), JoinedKeys)
        assert missing_from(joined(keys), empty) == keys and missing_from(empty, keys) == []


def test_every_rank_listing_the_same_buffer_is_the_first_itself() -> None:
    first = joined([bytes([i]) * 8 for i in range(100)])
    common, orphans = common_and_orphans(first, [JoinedKeys(bytes(bytearray(first.joined)), 8)] * 3)
    assert common is first and len(orphans) == 0


def test_lists_or_mixed_widths_take_the_set_code() -> None:
    a, b, c = b"aa", b"bbb", b"cc"
    assert common_and_orphans([a, b, c], [[c, a]]) == ([a, c], [b])
    assert common_and_orphans(joined([a, c]), [[c, b]]) == ([c], [a, b])
    assert common_and_orphans(joined([a, c]), [joined([b"xyz"])]) == ([], [a, c, b"xyz"])
    assert missing_from([a, b, c], joined([a, c])) == [b]


def test_a_fingerprint_clash_still_compares_whole_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key gets one fingerprint: membership falls back to comparing whole keys."""
    monkeypatch.setattr(
        joined_sets, "_fingerprints", lambda keys: np.zeros(len(keys), dtype=np.uint64)
    )
    keys = [bytes([i]) * 8 for i in range(6)]
    got = common_and_orphans(joined(keys), [joined(keys[::-2])])
    assert got == by_sets(keys, [keys[::-2]])
    assert missing_from(joined(keys), joined(keys[1::2])) == keys[::2]


def test_equal_to_the_set_code_on_random_listings() -> None:
    rng = random.Random(24)
    for width in (1, 3, 8, 13, 56):
        pool = [rng.randbytes(width) for _ in range(300)]
        for ranks in (2, 3, 4):
            listings = [rng.choices(pool, k=rng.randrange(0, 400)) for _ in range(ranks)]
            listings[0] = listings[0] or pool[:1]
            as_joined = [joined(ks, width) if ks else [] for ks in listings]
            assert common_and_orphans(as_joined[0], as_joined[1:]) == by_sets(
                listings[0], listings[1:]
            )
            assert common_keys(as_joined[0], as_joined[1:]) == by_sets(listings[0], listings[1:])[0]
            held = set(listings[1])
            assert missing_from(as_joined[0], as_joined[1]) == [
                k for k in listings[0] if k not in held
            ]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 9).flatmap(
        lambda w: st.lists(
            st.lists(st.binary(min_size=w, max_size=w), max_size=12), min_size=2, max_size=4
        )
    )
)
def test_equal_to_the_set_code_for_any_listings(listings: list[list[bytes]]) -> None:
    as_joined = [JoinedKeys.of(ks) or [] for ks in listings]
    assert common_and_orphans(as_joined[0], as_joined[1:]) == by_sets(listings[0], listings[1:])
    held = set(listings[1])
    assert missing_from(as_joined[0], as_joined[1]) == [k for k in listings[0] if k not in held]
