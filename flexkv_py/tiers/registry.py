"""Every lower tier, declared once, fastest first: a tier is its package under tiers/ (its
`LowerTier`, its opener, its `TierSpec`) plus its line in `_BUILT_IN` here. The manager, the
executor, the KV events and the connector ask the registry, never name a tier's role.

`register` adds a tier at run time (a test's stub tier, a plugin): its package defines the
tier's name (`tier_names.define_lower_tier`) and registers its spec before the engine that uses
it is built; `unregister` takes it out again.
"""

from __future__ import annotations

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.node.spec import SPEC as NODE
from flexkv_py.tiers.object.spec import SPEC as OBJECT
from flexkv_py.tiers.spec import Role, TierSpec
from flexkv_py.tiers.ssd.spec import SPEC as SSD

_BUILT_IN: tuple[TierSpec, ...] = (SSD, NODE, OBJECT)
_specs: dict[Tier, TierSpec] = {s.tier: s for s in _BUILT_IN}

# The medium each tier's KV events name (vLLM's "CPU" for host memory); a lower tier without
# one (a sibling engine's shard: that engine announces its blocks) is not announced. Kept in
# step with the specs, in place (the event queue holds this dict).
MEDIUM: dict[Tier, str] = {}


def _sync_media() -> None:
    MEDIUM.clear()
    MEDIUM[Tier.HOST] = "CPU"
    MEDIUM.update({s.tier: s.medium for s in _specs.values() if s.medium is not None})


_sync_media()


def specs() -> tuple[TierSpec, ...]:
    """Every registered lower tier, fastest first."""
    return tuple(_specs.values())


def spec_of(tier: Tier) -> TierSpec:
    spec = _specs.get(tier)
    if spec is None:
        raise KeyError(f"no lower tier {tier.value!r} is registered")
    return spec


def enabled_specs(config: FlexKVConfig) -> tuple[TierSpec, ...]:
    """The lower tiers this config asks for, fastest first."""
    return tuple(s for s in _specs.values() if s.enabled(config))


def spill_spec(config: FlexKVConfig) -> TierSpec | None:
    """The tier blocks leaving host memory are written to (None: they are dropped)."""
    return next((s for s in enabled_specs(config) if s.role is Role.SPILL), None)


def register(spec: TierSpec) -> None:
    """Add a lower tier (after those registered before: slower). Its name must be defined
    (`tier_names.define_lower_tier`); registering it twice is an error."""
    if spec.tier in _specs:
        raise ValueError(f"lower tier {spec.tier.value!r} is registered already")
    _specs[spec.tier] = spec
    _sync_media()


def unregister(tier: Tier) -> None:
    """Take a tier `register` added out again (a built-in tier stays)."""
    if any(s.tier is tier for s in _BUILT_IN):
        raise ValueError(f"{tier.value!r} is a built-in tier")
    _specs.pop(tier, None)
    _sync_media()
