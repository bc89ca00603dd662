"""The node tier's spec (tiers/spec.py): sibling engines' SSD shards on this node, read-only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.spec import Role, TierSpec, WrittenBy

if TYPE_CHECKING:
    from flexkv_py.tiers.node.shards import ReadOnlyShard
    from flexkv_py.tiers.protocol import LowerTier


def sibling_shards(config: FlexKVConfig, namespace: Namespace) -> list[ReadOnlyShard]:
    """Other engines' shards of this rank in the configured directories (read-only)."""
    from flexkv_py.tiers.node.shards import ReadOnlyShard

    root = config.ssd_cache_dir[0]
    try:
        names = sorted(n for n in os.listdir(root) if namespace.is_sibling_shard(n))
    except OSError:
        return []
    return [
        ReadOnlyShard(config, [os.path.join(d, n) for d in config.ssd_cache_dir]) for n in names
    ]


def _open(
    config: FlexKVConfig, namespace: Namespace, opened: Mapping[Tier, LowerTier]
) -> tuple[LowerTier | None, str | None]:
    """Only beside an SSD store of this engine's own (not a replica reader, not a failed
    open): the siblings' shards share its directories. A tier of their own: not this
    engine's SSD capacity."""
    from flexkv_py.tiers.node.shards import SiblingShards

    if not namespace.writes_lower_tiers or Tier.SSD not in opened:
        return None, None
    siblings = sibling_shards(config, namespace)
    return (SiblingShards(namespace, siblings), None) if siblings else (None, None)


SPEC = TierSpec(
    tier=Tier.NODE,
    role=Role.SIBLING,
    written_by=WrittenBy.NOBODY,
    capacity_authoritative=False,
    keeps_chains=False,
    medium=None,  # the sibling engine announces its blocks
    hit_source="DISK",  # a sibling engine's shard is SSD too
    enabled=lambda config: config.ssd_enabled and config.share_node_shards,
    io_timeout_s=lambda config: config.ssd_io_timeout_s,
    open=_open,
)
