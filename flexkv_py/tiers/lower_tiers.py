"""This rank's lower tiers, opened from the config: the `tiers` map the executor runs jobs on.

One opener per tier; a tier that is configured but cannot be opened is left out of the map and
named in `unavailable` with the reason (a degraded start, see tiers/ssd/opener.py): every job part
that names it then fails fast on the worker without touching a device.

Shards other processes write are read through tiers/node/shards.py: TP ranks > 0 of replicated
(MLA) KV read TP rank 0's copy instead of opening their own, and an engine with siblings on the
node (other engines' shards of its rank in the same directories) reads theirs too
(`share_node_shards`).

The object tier (tiers/object/opener.py) comes after the SSD, or is the only lower tier. Every
rank opens it, replicated (MLA) TP ranks > 0 read-only: their keys carry rank 0's tag, so
they read the one copy rank 0 writes.
"""

from __future__ import annotations

import os

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.node.shards import ReadOnlyShard, ReplicaReader, SiblingShards
from flexkv_py.tiers.object.opener import open_object_tier
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.ssd.opener import open_ssd_tier


def configured_tiers(config: FlexKVConfig) -> tuple[Tier, ...]:
    """The lower tiers this config asks for, fastest first."""
    ssd = (Tier.SSD,) if config.ssd_enabled else ()
    return ssd + ((Tier.OBJECT,) if config.object_enabled else ())


def open_lower_tiers(
    config: FlexKVConfig, namespace: Namespace
) -> tuple[dict[Tier, LowerTier], dict[Tier, str]]:
    """(tier -> open tier, tier -> why it could not be opened) for this rank."""
    tiers: dict[Tier, LowerTier] = {}
    unavailable: dict[Tier, str] = {}
    if Tier.SSD in configured_tiers(config):
        _open_ssd(config, namespace, tiers, unavailable)
    if Tier.OBJECT in configured_tiers(config):
        obj, why = open_object_tier(config, namespace, read_only=not namespace.writes_lower_tiers)
        if obj is not None:
            tiers[Tier.OBJECT] = obj
        elif why is not None:
            unavailable[Tier.OBJECT] = why
    return tiers, unavailable


def _open_ssd(
    config: FlexKVConfig,
    namespace: Namespace,
    tiers: dict[Tier, LowerTier],
    unavailable: dict[Tier, str],
) -> None:
    if not namespace.writes_lower_tiers:
        dirs = [os.path.join(d, namespace.shard_dir_name) for d in config.ssd_cache_dir]
        tiers[Tier.SSD] = ReplicaReader(namespace, ReadOnlyShard(config, dirs))
        return
    ssd, why = open_ssd_tier(config, namespace)
    if ssd is not None:
        tiers[Tier.SSD] = ssd
        siblings = sibling_shards(config, namespace) if config.share_node_shards else []
        if siblings:  # a tier of their own: not this engine's SSD capacity (tiers/node/shards.py)
            tiers[Tier.NODE] = SiblingShards(namespace, siblings)
    elif why is not None:
        unavailable[Tier.SSD] = why


def sibling_shards(config: FlexKVConfig, namespace: Namespace) -> list[ReadOnlyShard]:
    """Other engines' shards of this rank in the configured directories (read-only)."""
    root = config.ssd_cache_dir[0]
    try:
        names = sorted(n for n in os.listdir(root) if namespace.is_sibling_shard(n))
    except OSError:
        return []
    return [
        ReadOnlyShard(config, [os.path.join(d, n) for d in config.ssd_cache_dir]) for n in names
    ]
