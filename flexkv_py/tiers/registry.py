"""Every lower tier, declared once, fastest first: a new tier is its package under tiers/ plus
one line here."""

from __future__ import annotations

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.node.spec import SPEC as NODE
from flexkv_py.tiers.object.spec import SPEC as OBJECT
from flexkv_py.tiers.spec import Role, TierSpec
from flexkv_py.tiers.ssd.spec import SPEC as SSD

SPECS: tuple[TierSpec, ...] = (SSD, NODE, OBJECT)
BY_TIER: dict[Tier, TierSpec] = {s.tier: s for s in SPECS}


def spec_of(tier: Tier) -> TierSpec:
    return BY_TIER[tier]


def enabled_specs(config: FlexKVConfig) -> tuple[TierSpec, ...]:
    """The lower tiers this config asks for, fastest first."""
    return tuple(s for s in SPECS if s.enabled(config))


def spill_spec(config: FlexKVConfig) -> TierSpec | None:
    """The tier blocks leaving host memory are written to (None: they are dropped)."""
    return next((s for s in enabled_specs(config) if s.role is Role.SPILL), None)
