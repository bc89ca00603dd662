"""Keys of one width joined into one bytes object: a restart's listing of millions of blocks
without a Python object per block (issue 24: RSS per cached block).

A restart lists every block a shard holds (tiers/ssd/inventory.py), adopts them all as cold
blocks (the Rust sets take the buffer whole: `BlockSet.add_joined`) and keeps them until the
workers' reports settle what was adopted (coordinator/adopted_before.py). A million bytes
objects made for that and freed later leave Python's small-object arenas pinned by whatever
survived among them; one buffer leaves nothing behind. The keys of one namespace have one
width (its head and the engine's hash), so they split back unambiguously.

A `Sequence[bytes]`: code that needs the keys one by one (an index with entries, several
shards to intersect, a settle that differs) gets them, split as it goes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import overload


class JoinedKeys(Sequence[bytes]):
    __slots__ = ("joined", "width")

    def __getstate__(self) -> tuple[bytes, int]:
        return self.joined, self.width

    def __setstate__(self, state: tuple[bytes, int]) -> None:
        self.joined, self.width = state

    def __init__(self, joined: bytes, width: int) -> None:
        if width <= 0 and joined:
            raise ValueError(f"joined keys need a width > 0, got {width}")
        if joined and len(joined) % width:
            raise ValueError(f"{len(joined)} bytes are not whole keys of {width} bytes")
        self.joined = joined
        self.width = width

    @classmethod
    def of(cls, keys: Sequence[bytes]) -> JoinedKeys | None:
        """`keys` joined; None when they are not all one width (or there are none)."""
        if not keys:
            return None
        width = len(keys[0])
        if width == 0 or set(map(len, keys)) != {width}:
            return None
        return cls(b"".join(keys), width)

    def __len__(self) -> int:
        return len(self.joined) // self.width if self.joined else 0

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            w, joined = self.width, self.joined
            return [joined[j * w : (j + 1) * w] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("JoinedKeys index out of range")
        return self.joined[i * self.width : (i + 1) * self.width]

    def __iter__(self) -> Iterator[bytes]:
        w, joined = self.width, self.joined
        if not joined:
            return iter(())  # an empty listing may have no width (0)
        return (joined[j : j + w] for j in range(0, len(joined), w))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, JoinedKeys):
            return (self.joined, self.width) == (other.joined, other.width) or (
                not self.joined and not other.joined
            )
        if isinstance(other, Sequence):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"JoinedKeys({len(self)} keys of {self.width} bytes)"


class JoinedLinks(Mapping[bytes, bytes]):
    """Chain links joined: `children[i]` extends `parents[i]` (a restart's report of a store's
    chains, `BlockStore.inventory_joined`), adopted straight from the buffers
    (`BlockSet.link_joined`). A `Mapping` child -> parent for code that needs them one by one
    (a dict of them is built then)."""

    __slots__ = ("_by_child", "children", "parents")

    def __init__(self, children: JoinedKeys, parents: JoinedKeys) -> None:
        if len(children) != len(parents) or (children and children.width != parents.width):
            raise ValueError("joined links need as many parents as children, of one width")
        self.children = children
        self.parents = parents
        self._by_child: dict[bytes, bytes] | None = None

    def __bool__(self) -> bool:
        return bool(self.children)

    def __getstate__(self) -> tuple[JoinedKeys, JoinedKeys]:
        return self.children, self.parents

    def __setstate__(self, state: tuple[JoinedKeys, JoinedKeys]) -> None:
        self.children, self.parents = state
        self._by_child = None

    def _dict(self) -> dict[bytes, bytes]:
        if self._by_child is None:
            self._by_child = dict(zip(self.children, self.parents, strict=True))
        return self._by_child

    def __getitem__(self, child: bytes) -> bytes:
        return self._dict()[child]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict()) if self._by_child is not None else len(self.children)

    def __repr__(self) -> str:
        return f"JoinedLinks({len(self.children)} links)"


def merge_links(a: Mapping[bytes, bytes], b: Mapping[bytes, bytes]) -> Mapping[bytes, bytes]:
    """Chain links of two reports: one worker sends them (worker (0, 0)), so one side is
    usually empty and the other is kept as is (joined links stay joined)."""
    if not b:
        return a
    if not a:
        return b
    return {**a, **b}
