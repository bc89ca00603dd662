"""The object tier's spec (tiers/spec.py): the fleet's shared bucket."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.spec import Role, TierSpec, WrittenBy

if TYPE_CHECKING:
    from flexkv_py.tiers.protocol import LowerTier


def _open(
    config: FlexKVConfig, namespace: Namespace, opened: Mapping[Tier, LowerTier]
) -> tuple[LowerTier | None, str | None]:
    """Every rank opens it; replicated (MLA) TP ranks > 0 read-only: their keys carry rank
    0's tag, so they read the one copy rank 0 writes."""
    from flexkv_py.tiers.object.opener import open_object_tier

    return open_object_tier(config, namespace, read_only=not namespace.writes_lower_tiers)


SPEC = TierSpec(
    tier=Tier.OBJECT,
    role=Role.SHARED,
    written_by=WrittenBy.OWNERS,
    capacity_authoritative=False,
    keeps_chains=True,
    medium="OBJECT",
    hit_source="EXTERNAL_UNSPECIFIED",  # vLLM's name for a remote store
    enabled=lambda config: config.object_enabled,
    io_timeout_s=lambda config: config.object_store_io_timeout_s,
    open=_open,
)
