"""Blocks a restart adopted before the workers reported their shards (from the scheduler's own
read of the shards, tiers/ssd/inventory.py), kept until the reports come to settle the
difference.

The reports are the authority: a block they do not all list was dropped by a worker's recovery
(or a worker has no SSD tier) and must leave the index; one only they list is adopted then. A
block listed by both is not adopted again: the scheduler may have evicted it meanwhile (its
delete went to the workers after the snapshot they reported).

Nothing is computed at adoption (restarts adopt millions of blocks, and the first scheduler
call waits for it): the keys are kept as read, in the shard's order, which is the order the
workers list them in when nothing changed in between. So settling is one comparison, and sets
are built only when the two differ.

Kept packed: the keys of a namespace all have one length (its head and the engine's hash), so
they are held as one joined bytes object, not a million bytes objects. Those would live from
the read until the first step's reports, and a few survivors among them keep Python's
small-object arenas from going back to the OS (issue 24: RSS per cached block). Keys of mixed
lengths (tests' keys) are kept as the list they came in.
"""

from __future__ import annotations

from collections.abc import Sequence


class AdoptedBefore:
    def __init__(self, keys: Sequence[bytes]) -> None:
        self._n = len(keys)
        self._width = len(keys[0]) if keys else 0
        self._joined: bytes | None = None
        self._keys: list[bytes] = []
        if keys and _one_width(keys, self._width):
            self._joined = b"".join(keys)
        else:
            self._keys = list(keys)

    def __len__(self) -> int:
        return self._n

    def _take(self) -> tuple[bytes | None, list[bytes]]:
        joined, keys = self._joined, self._keys
        self._joined, self._keys, self._n = None, [], 0
        return joined, keys

    def settle(self, reported: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """(keys `reported` and not adopted before, keys adopted before and not `reported`);
        once: it forgets what it held."""
        n, width = self._n, self._width
        joined, before = self._take()
        if len(reported) == n:
            if joined is not None:
                if _one_width(reported, width) and b"".join(reported) == joined:
                    return [], []
            elif before == list(reported):
                return [], []
        if joined is not None:
            before = [joined[i : i + width] for i in range(0, len(joined), width)]
            del joined
        known = set(before)
        new = [k for k in reported if k not in known]
        kept = set(reported)
        return new, [k for k in before if k not in kept]


def _one_width(keys: Sequence[bytes], width: int) -> bool:
    """Every key is `width` bytes long (then joined keys split back unambiguously)."""
    return set(map(len, keys)) == {width}
