"""The SSD tier's spec (tiers/spec.py): the local block store, this engine's spill tier."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.lower_capacity import store_capacity_blocks
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.spec import Role, TierSpec, WrittenBy

if TYPE_CHECKING:
    from flexkv_py.tiers.protocol import LowerTier


def _open(
    config: FlexKVConfig, namespace: Namespace, opened: Mapping[Tier, LowerTier]
) -> tuple[LowerTier | None, str | None]:
    """A rank that writes opens its own store; a replicated (MLA) TP rank > 0 reads rank 0's
    copy instead (tiers/node/shards.py)."""
    from flexkv_py.tiers.node.shards import ReadOnlyShard, ReplicaReader
    from flexkv_py.tiers.ssd.opener import open_ssd_tier

    if not namespace.writes_lower_tiers:
        dirs = [os.path.join(d, namespace.shard_dir_name) for d in config.ssd_cache_dir]
        return ReplicaReader(namespace, ReadOnlyShard(config, dirs)), None
    return open_ssd_tier(config, namespace)


def capacity_blocks(config: FlexKVConfig, namespace: Namespace, slot_nbytes: int) -> int:
    """Blocks one rank's SSD store holds: its share of ssd_cache_gb over its directories, each
    block a whole host slot (index/lower_capacity.py)."""
    return store_capacity_blocks(
        namespace.rank_share(config.ssd_cache_bytes), len(config.ssd_cache_dir), slot_nbytes
    )


SPEC = TierSpec(
    tier=Tier.SSD,
    role=Role.SPILL,
    written_by=WrittenBy.OWNERS,
    capacity_authoritative=True,
    keeps_chains=False,
    medium="SSD",
    hit_source="DISK",
    enabled=lambda config: config.ssd_enabled,
    io_timeout_s=lambda config: config.ssd_io_timeout_s,
    open=_open,
    capacity_blocks=capacity_blocks,
)
