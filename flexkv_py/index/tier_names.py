"""The tier vocabulary, defined once: every job, result, index entry and stat names a tier
with these values. The index layer is the lowest one that needs it, so it lives here."""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum


class Tier(str, Enum):
    """Where a block's bytes live below the GPU. Ordered fastest first."""

    HOST = "host"  # a pinned host-memory slot
    SSD = "ssd"  # the local block store (io_uring / O_DIRECT)
    NODE = "node"  # sibling engines' SSD shards on this node, read-only (tiers/node/shards.py)
    OBJECT = "object"  # the bucket shared by the fleet (tiers/object/)


# Tiers below the host tier: a block reaches them from its host slot and comes back through one.
LOWER_TIERS: tuple[Tier, ...] = (Tier.SSD, Tier.NODE, Tier.OBJECT)


def lower_in_order(named: Collection[Tier | None]) -> list[Tier]:
    """The lower tiers among `named`, fastest first (host and None are not lower tiers)."""
    return [t for t in LOWER_TIERS if t in named]
