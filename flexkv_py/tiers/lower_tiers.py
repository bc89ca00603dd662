"""This rank's lower tiers, opened from the config: the `tiers` map the executor runs jobs on.

Each tier's spec (tiers/registry.py) opens it, fastest first, given the tiers opened before it
(the node tier's sibling shards share the SSD's directories). A tier that is configured but
cannot be opened is left out of the map and named in `unavailable` with the reason (a degraded
start, see tiers/ssd/opener.py): every job part that names it then fails fast on the worker
without touching a device.
"""

from __future__ import annotations

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.registry import enabled_specs


def configured_tiers(config: FlexKVConfig) -> tuple[Tier, ...]:
    """The lower tiers this config asks for, fastest first."""
    return tuple(spec.tier for spec in enabled_specs(config))


def open_lower_tiers(
    config: FlexKVConfig, namespace: Namespace
) -> tuple[dict[Tier, LowerTier], dict[Tier, str]]:
    """(tier -> open tier, tier -> why it could not be opened) for this rank."""
    tiers: dict[Tier, LowerTier] = {}
    unavailable: dict[Tier, str] = {}
    for spec in enabled_specs(config):
        lower, why = spec.open(config, namespace, tiers)
        if lower is not None:
            tiers[spec.tier] = lower
        elif why is not None:
            unavailable[spec.tier] = why
    return tiers, unavailable
