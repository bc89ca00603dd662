"""The tier vocabulary, defined once: every job, result, index entry and stat names a tier
with these values. The index layer is the lowest one that needs it, so it lives here.

`Tier` is a name, interned: one object per tier, so tiers compare with `is`, and a job that
names one pickles as the name. The built-in tiers are below; a new lower tier defines its name
with `define_lower_tier` (its package does, next to its spec in tiers/registry.py), which gives
it the next bit of the index's masks (`TIER_BIT`). Lower tiers are ordered fastest first; a new
one comes after those defined before it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar


class Tier(str):
    """Where a block's bytes live below the GPU."""

    __slots__ = ()
    _named: ClassVar[dict[str, Tier]] = {}
    HOST: ClassVar[Tier]  # a pinned host-memory slot
    SSD: ClassVar[Tier]  # the local block store (io_uring / O_DIRECT)
    NODE: ClassVar[Tier]  # sibling engines' SSD shards on this node, read-only (tiers/node/)
    OBJECT: ClassVar[Tier]  # the bucket shared by the fleet (tiers/object/)

    def __new__(cls, value: str) -> Tier:
        """The tier named `value` (ValueError for a name no tier has)."""
        tier = cls._named.get(value)
        if tier is None:
            known = ", ".join(cls._named)
            raise ValueError(f"{value!r} is not a tier (known: {known})")
        return tier

    @classmethod
    def _define(cls, value: str) -> Tier:
        tier = cls._named.get(value)
        if tier is None:
            tier = cls._named[value] = str.__new__(cls, value)
        return tier

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return self.value.upper()

    def __repr__(self) -> str:
        return f"Tier.{self.name}"

    def __str__(self) -> str:
        return self.value

    def __reduce__(self) -> tuple[type[Tier], tuple[str]]:
        return (Tier, (self.value,))


Tier.HOST = Tier._define("host")
Tier.SSD = Tier._define("ssd")
Tier.NODE = Tier._define("node")
Tier.OBJECT = Tier._define("object")

# Tiers below the host tier, fastest first: a block reaches them from its host slot and comes
# back through one. Grows (in place) as tiers are defined; never shrinks.
LOWER_TIERS: list[Tier] = [Tier.SSD, Tier.NODE, Tier.OBJECT]

# Bit of each lower tier in the index's masks (`Entry.lower` / `Entry.pending`), in
# LOWER_TIERS order.
TIER_BIT: dict[Tier, int] = {tier: 1 << i for i, tier in enumerate(LOWER_TIERS)}


def define_lower_tier(value: str) -> Tier:
    """The lower tier named `value`, defined now (after every lower tier defined before) or
    found (defined already). Define it before the index that holds its blocks is built."""
    if value in Tier._named:
        tier = Tier(value)
        if tier not in TIER_BIT:
            raise ValueError(f"{value!r} names the host tier, not a lower tier")
        return tier
    if not value or not value.isidentifier() or value != value.lower():
        raise ValueError(f"a tier name is a lower-case identifier, got {value!r}")
    tier = Tier._define(value)
    TIER_BIT[tier] = 1 << len(LOWER_TIERS)
    LOWER_TIERS.append(tier)
    return tier


def lower_in_order(named: Collection[Tier | None]) -> list[Tier]:
    """The lower tiers among `named`, fastest first (host and None are not lower tiers)."""
    return [t for t in LOWER_TIERS if t in named]
