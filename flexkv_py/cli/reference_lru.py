"""Ideal-cache references for `flexkv-py replay`: the hit rate of one LRU of N blocks over the
same requests (a request hits its longest cached prefix, then every block of it is used).

Two sizes are printed next to ours: GPU + SSD blocks (an SSD that also holds the host tier's
blocks, as write-behind makes it) and GPU + host + SSD (every block we have room for).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def lru_hit_rate(requests: Iterable[Sequence[bytes]], capacity: int) -> float:
    """Prefix-hit blocks / all blocks for a single LRU of `capacity` blocks."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    hits = blocks = 0
    for keys in requests:
        n = 0
        while n < len(keys) and keys[n] in lru:
            n += 1
        hits += n
        blocks += len(keys)
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits / blocks if blocks else 0.0
