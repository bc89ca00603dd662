"""This rank's lower tiers, opened from the config: the `tiers` map the executor runs jobs on.

One opener per tier; a tier that is configured but cannot be opened is left out of the map and
named in `unavailable` with the reason (a degraded start, see tiers/ssd_open.py): every job part
that names it then fails fast on the worker without touching a device.
"""

from __future__ import annotations

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.ssd_open import open_ssd_tier


def configured_tiers(config: FlexKVConfig) -> tuple[Tier, ...]:
    """The lower tiers this config asks for, fastest first."""
    return (Tier.SSD,) if config.ssd_enabled else ()


def open_lower_tiers(
    config: FlexKVConfig, namespace: Namespace
) -> tuple[dict[Tier, LowerTier], dict[Tier, str]]:
    """(tier -> open tier, tier -> why it could not be opened) for this rank."""
    tiers: dict[Tier, LowerTier] = {}
    unavailable: dict[Tier, str] = {}
    if Tier.SSD in configured_tiers(config):
        ssd, why = open_ssd_tier(config, namespace)
        if ssd is not None:
            tiers[Tier.SSD] = ssd
        elif why is not None:
            unavailable[Tier.SSD] = why
    return tiers, unavailable
