"""Blocks a restart adopted before the workers reported their shards (from the scheduler's own
read of the shards, tiers/ssd/inventory.py), kept until the reports come to settle the
difference.

The reports are the authority: a block they do not all list was dropped by a worker's recovery
(or a worker has no SSD tier) and must leave the index; one only they list is adopted then. A
block listed by both is not adopted again: the scheduler may have evicted it meanwhile (its
delete went to the workers after the snapshot they reported).

Nothing is computed at adoption (restarts adopt millions of blocks, and the first scheduler
call waits for it): the keys are kept as read, in the shard's order, which is the order the
workers list them in when nothing changed in between. So settling is one list comparison, and
sets are built only when the two differ.
"""

from __future__ import annotations

from collections.abc import Sequence


class AdoptedBefore:
    def __init__(self, keys: list[bytes]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def settle(self, reported: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """(keys `reported` and not adopted before, keys adopted before and not `reported`);
        once: it forgets what it held."""
        before, self._keys = self._keys, []
        if len(before) == len(reported) and before == list(reported):
            return [], []
        known = set(before)
        new = [k for k in reported if k not in known]
        kept = set(reported)
        return new, [k for k in before if k not in kept]
