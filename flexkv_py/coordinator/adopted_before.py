"""Blocks a restart adopted before the workers reported their shards (from the scheduler's own
read of the shards, tiers/ssd/inventory.py), kept until the reports come to settle the
difference.

The reports are the authority: a block they do not all list was dropped by a worker's recovery
(or a worker has no SSD tier) and must leave the index; one only they list is adopted then. A
block listed by both is not adopted again: the scheduler may have evicted it meanwhile (its
delete went to the workers after the snapshot they reported).

Nothing is computed at adoption (restarts adopt millions of blocks, and the first scheduler
call waits for it): the keys are kept as read, in the shard's order, which is the order the
workers list them in when nothing changed in between. So settling is one comparison; when the
two differ, joined keys are compared as buffers (index/joined_sets.py) and others as sets.

Kept packed: the keys of a namespace all have one length (its head and the engine's hash), so
they are held as one joined bytes object, not a million bytes objects. Those would live from
the read until the first step's reports, and a few survivors among them keep Python's
small-object arenas from going back to the OS (issue 24: RSS per cached block). Keys of mixed
lengths (tests' keys) are kept as the list they came in.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.joined_sets import missing_from


class AdoptedBefore:
    def __init__(self, keys: Sequence[bytes]) -> None:
        self._n = len(keys)
        self._joined = keys if isinstance(keys, JoinedKeys) else JoinedKeys.of(keys)
        self._keys: list[bytes] = [] if self._joined is not None else list(keys)

    def __len__(self) -> int:
        return self._n

    def settle(self, reported: Sequence[bytes]) -> tuple[Sequence[bytes], Sequence[bytes]]:
        """(keys `reported` and not adopted before, keys adopted before and not `reported`);
        once: it forgets what it held."""
        joined, listed = self._joined, self._keys
        self._joined, self._keys, self._n = None, [], 0
        if joined is not None:
            as_joined = _joined_as(reported, joined.width)
            if as_joined is not None:
                reported = as_joined
            if len(reported) == len(joined) and reported == joined:
                return [], []
        elif listed == list(reported):
            return [], []
        before: Sequence[bytes] = listed if joined is None else joined
        # They differ: joined keys (the usual reports) are compared as buffers, others as sets.
        return missing_from(reported, before), missing_from(before, reported)


def _joined_as(keys: Sequence[bytes], width: int) -> JoinedKeys | None:
    """`keys` joined if they are all `width` bytes long (a report may come joined already)."""
    if isinstance(keys, JoinedKeys):
        return keys if keys.width == width else None
    joined = JoinedKeys.of(keys)
    return joined if joined is not None and joined.width == width else None
