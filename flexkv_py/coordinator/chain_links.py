"""Chain links the object tier's manifests need: block -> its chain parent, for blocks this
worker stored or found in the bucket. A lookup by another worker finds a prefix in the bucket
only through the manifests (tiers/object/tier.py), and a manifest is written for a whole chain,
so an upload carries its blocks' parents and the links up to their roots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

LINKS_CAP = 1 << 20  # remembered links (a forgotten one only costs a manifest)


class ChainLinks:
    def __init__(self, cap: int = LINKS_CAP) -> None:
        self._cap = cap
        self._links: OrderedDict[bytes, bytes | None] = OrderedDict()

    def remember(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        links = self._links
        for key, parent in zip(keys, parents, strict=True):
            links[key] = parent
            links.move_to_end(key)
        while len(links) > self._cap:
            links.popitem(last=False)

    def parent(self, key: bytes) -> bytes | None:
        return self._links.get(key)

    def parent_waits_in(self, key: bytes, queue: Container[bytes]) -> bool:
        """The block's parent is still owed to the tier (in `queue`): it goes first."""
        return self._links.get(key) in queue

    def ancestors(self, keys: Sequence[bytes]) -> list[tuple[bytes, bytes | None]]:
        """Links from `keys` up to their roots that `keys` do not carry: the object tier needs a
        block's whole chain to write its manifests, and a prefix this worker loaded (not
        stored) reaches it only this way."""
        links, inside = self._links, set(keys)
        out: list[tuple[bytes, bytes | None]] = []
        seen: set[bytes] = set()
        for key in keys:
            at = links.get(key)
            while at is not None and at not in inside and at not in seen and at in links:
                seen.add(at)
                parent = links[at]
                out.append((at, parent))
                at = parent
        return out

    def root_first(self, keys: list[bytes], slots: list[int]) -> tuple[list[bytes], list[int]]:
        """`keys` (and their `slots`) ordered so that each comes after its parent (stores can
        commit out of order): the object tier then puts each chain in one batch, ancestors
        included, and writes its manifests (none for a segment whose ancestors are not stored
        yet)."""
        links, inside = self._links, set(keys)
        depth: dict[bytes, int] = {}
        for key in keys:
            n, at = 0, links.get(key)
            while at is not None and at in inside and n <= len(keys):
                n, at = n + 1, links.get(at)
            depth[key] = n
        order = sorted(range(len(keys)), key=lambda i: depth[keys[i]])
        return [keys[i] for i in order], [slots[i] for i in order]
