"""The stub tier's spec: a spill tier (blocks leaving host memory go there) whose evictions the
index decides, for configs without an SSD tier, while registered."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier, define_lower_tier
from flexkv_py.tiers import registry
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.spec import Role, TierSpec, WrittenBy

from .tier import DictTier

STUB = define_lower_tier("stub")
CAPACITY_BLOCKS = 24
opened: list[DictTier] = []  # every tier the spec opened, for the tests to look into


def _open(
    config: FlexKVConfig, namespace: Namespace, before: Mapping[Tier, LowerTier]
) -> tuple[LowerTier | None, str | None]:
    tier = DictTier(STUB)
    opened.append(tier)
    return tier, None


SPEC = TierSpec(
    tier=STUB,
    role=Role.SPILL,
    written_by=WrittenBy.OWNERS,
    capacity_authoritative=True,
    keeps_chains=False,
    medium="STUB",
    hit_source="DISK",
    enabled=lambda config: not config.ssd_enabled,
    io_timeout_s=lambda config: 1.0,
    open=_open,
    capacity_blocks=lambda config, namespace, slot_nbytes: CAPACITY_BLOCKS,
)


@contextmanager
def registered() -> Iterator[TierSpec]:
    """The stub tier registered for the duration (every engine built inside uses it)."""
    registry.register(SPEC)
    try:
        yield SPEC
    finally:
        registry.unregister(STUB)
        opened.clear()
