"""Set operations over the ranks' key listings of a restart, done on joined buffers
(index/joined_keys.py) with numpy: no Python object per key (issue 24: RSS per cached block).

Under TP/PP every rank holds its own shard of each block, so a restart keeps the blocks every
shard holds (`common_keys`: the scheduler's read; `common_and_orphans`: the workers' reports,
whose other blocks are deleted) and settles what it adopted early against the reports
(`missing_from`). Sets of millions of bytes objects for that would leave Python's arenas
pinned, as the single-rank path no longer does.

Membership is found through a 64-bit fingerprint of each key: the haystack's fingerprints are
sorted once, the needles' searched in them, and every hit is confirmed by comparing the whole
key. Two different keys of one haystack with one fingerprint would hide one of them, so that
case (never seen with hashed keys) falls back to numpy's exact, slower `isin` on the keys.

Keys are fixed-width byte strings (`S{width}` arrays): compared and sorted byte by byte as
unsigned, as Python compares bytes. Converting one element to Python bytes would drop trailing
NULs, so results are cut from the arrays with `tobytes()` only. Inputs that are not joined,
or joined at different widths, take the set code this replaced.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from flexkv_py.index.joined_keys import JoinedKeys

_Keys = npt.NDArray[np.bytes_]
_Mask = npt.NDArray[np.bool_]
_Words = npt.NDArray[np.uint64]

_SEED = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xFF51AFD7ED558CCD)  # murmur3's finalizer constant
_SHIFT = np.uint64(33)


def common_keys(first: Sequence[bytes], others: Sequence[Sequence[bytes]]) -> Sequence[bytes]:
    """The keys of `first` that every one of `others` holds, in `first`'s order (duplicates
    kept); joined when all are joined at one width."""
    joined = _joined_all([first, *others])
    if joined is None:
        held = [set(o) for o in others]
        return [k for k in first if all(k in h for h in held)]
    if _all_same(joined):
        return joined[0]
    common, _ = _common([_Listing.of(ks) for ks in joined])
    return JoinedKeys(common.keys.tobytes(), joined[0].width)


def common_and_orphans(
    first: Sequence[bytes], others: Sequence[Sequence[bytes]]
) -> tuple[Sequence[bytes], Sequence[bytes]]:
    """(`common_keys`, orphans: the keys some but not all hold, sorted, each once)."""
    joined = _joined_all([first, *others])
    if joined is None:
        held = [set(o) for o in others]
        common = [k for k in first if all(k in h for h in held)]
        kept = set(common)
        return common, sorted({k for ks in (first, *others) for k in ks if k not in kept})
    width = joined[0].width
    if _all_same(joined):
        return joined[0], JoinedKeys(b"", width)
    listings = [_Listing.of(ks) for ks in joined]
    in_all, in_all_mask = _common(listings)
    # The first's keys outside the common part, then each other's not in it.
    pieces = [listings[0].keys[~in_all_mask]]
    pieces += [other.keys[~_member(other, in_all)] for other in listings[1:]]
    orphans = np.unique(np.concatenate(pieces))
    return JoinedKeys(in_all.keys.tobytes(), width), JoinedKeys(orphans.tobytes(), width)


def missing_from(keys: Sequence[bytes], other: Sequence[bytes]) -> Sequence[bytes]:
    """The keys of `keys` that `other` lacks, in `keys`' order; joined when both are."""
    joined = _joined_all([keys, other])
    if joined is None:
        held = set(other)
        return [k for k in keys if k not in held]
    a, b = (_Listing.of(ks) for ks in joined)
    return JoinedKeys(a.keys[~_member(a, b)].tobytes(), joined[0].width)


def _joined_all(listings: Sequence[Sequence[bytes]]) -> list[JoinedKeys] | None:
    """Every listing as joined keys of one width (an empty one fits any), or None."""
    widths = {ks.width for ks in listings if isinstance(ks, JoinedKeys) and ks}
    if len(widths) != 1 or any(ks and not isinstance(ks, JoinedKeys) for ks in listings):
        return None
    (width,) = widths
    return [ks if isinstance(ks, JoinedKeys) and ks else JoinedKeys(b"", width) for ks in listings]


def _all_same(joined: Sequence[JoinedKeys]) -> bool:
    """Every shard lists the same blocks in the same order: the usual restart (each rank
    stores every job's blocks), found by comparing buffers."""
    return all(ks.joined == joined[0].joined for ks in joined[1:])


class _Listing:
    """One listing's keys as an `S{width}` array (over its buffer: no copy), their
    fingerprints, and the order that sorts those (made when first searched)."""

    __slots__ = ("_order", "fps", "keys")

    def __init__(self, keys: _Keys, fps: _Words | None = None) -> None:
        self.keys = keys
        self.fps = _fingerprints(keys) if fps is None else fps
        self._order: npt.NDArray[np.intp] | None = None

    @classmethod
    def of(cls, joined: JoinedKeys) -> _Listing:
        return cls(np.frombuffer(joined.joined, dtype=f"S{joined.width}"))

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def order(self) -> npt.NDArray[np.intp]:
        if self._order is None:
            self._order = np.argsort(self.fps)
        return self._order

    def subset(self, mask: _Mask) -> _Listing:
        return _Listing(self.keys[mask], self.fps[mask])


def _common(listings: Sequence[_Listing]) -> tuple[_Listing, _Mask]:
    """The first listing's keys every other holds, and the mask that picks them."""
    first = listings[0]
    in_all = np.ones(len(first), dtype=bool)
    for other in listings[1:]:
        in_all &= _member(first, other)
    return first.subset(in_all), in_all


def _fingerprints(keys: _Keys) -> _Words:
    """A 64-bit mix of each key's bytes, read as little-endian words (zero-padded to 8)."""
    width = keys.dtype.itemsize
    rows = keys.view(np.uint8).reshape(len(keys), width)
    if width % 8:
        padded = np.zeros((len(keys), -(-width // 8) * 8), dtype=np.uint8)
        padded[:, :width] = rows
        rows = padded
    words = rows.view("<u8")
    out = np.full(len(keys), _SEED, dtype=np.uint64)
    for column in range(words.shape[1]):
        out ^= words[:, column]
        out *= _MIX  # wraps, as intended
        out ^= out >> _SHIFT
    return out


def _member(needles: _Listing, hay: _Listing) -> _Mask:
    """Which of `needles`' keys are in `hay`."""
    if not len(hay) or not len(needles):
        return np.zeros(len(needles), dtype=bool)
    sorted_fps = hay.fps[hay.order]
    same_fp = np.flatnonzero(sorted_fps[1:] == sorted_fps[:-1])
    if len(same_fp) and np.any(hay.keys[hay.order[same_fp]] != hay.keys[hay.order[same_fp + 1]]):
        return np.isin(needles.keys, hay.keys)  # two keys share a fingerprint: whole keys
    # Sorted needles searched in sorted fingerprints: a merge, not a million random searches.
    at = np.empty(len(needles), dtype=np.intp)
    at[needles.order] = np.searchsorted(sorted_fps, needles.fps[needles.order])
    at[at == len(sorted_fps)] = 0  # past the end: a miss, confirmed below
    return (sorted_fps[at] == needles.fps) & (hay.keys[hay.order[at]] == needles.keys)
