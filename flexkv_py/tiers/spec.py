"""What the rest of the coordinator needs to know about a lower tier, as plain data: one
`TierSpec` per tier, listed once in tiers/registry.py. The manager, the executor, the KV events
and the vLLM connector loop over the specs instead of naming tiers; each tier's code (its
`LowerTier`, its opener, its spec) lives in its own package under tiers/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from flexkv_py.config import FlexKVConfig
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier

if TYPE_CHECKING:
    from flexkv_py.tiers.protocol import LowerTier


class Role(str, Enum):
    """How blocks reach a tier and who else uses it."""

    # Blocks leaving host memory are written here (eviction, write-back) and by write-behind;
    # this engine owns what it holds (deleted on reset, evicted by the index's choice).
    SPILL = "spill"
    # The fleet's shared store: written by write-behind, present bits are hints (others
    # collect it), never deleted by a reset of ours.
    SHARED = "shared"
    # Other engines' shards on this node: read only, they announce and evict their blocks.
    SIBLING = "sibling"


class WrittenBy(str, Enum):
    """Which ranks write the tier."""

    OWNERS = "owners"  # every rank that owns its KV (not a replicated MLA rank > 0)
    NOBODY = "nobody"  # read-only here


# (config, namespace, tiers opened before this one) -> (tier, None), (None, None) when off, or
# (None, why) when it cannot be opened (the engine serves without it).
Opener = Callable[
    [FlexKVConfig, Namespace, Mapping[Tier, "LowerTier"]], "tuple[LowerTier | None, str | None]"
]


@dataclass(frozen=True)
class TierSpec:
    tier: Tier
    role: Role
    written_by: WrittenBy
    # The index decides the tier's evictions (its capacity from the config is exact): every
    # write is given room by deleting what the index chose, before the write.
    capacity_authoritative: bool
    # The tier's manifests need each block's chain (the object tier's prefix lookups).
    keeps_chains: bool
    # KV event medium ("SSD", "OBJECT"); None: not announced by this engine.
    medium: str | None
    # vLLM's CacheHitSource member for tokens served from the tier (vLLM 0.33+).
    hit_source: str
    enabled: Callable[[FlexKVConfig], bool]
    io_timeout_s: Callable[[FlexKVConfig], float]
    open: Opener
    # Blocks of `slot_nbytes` one rank's share of the tier holds, when the index decides its
    # evictions (`capacity_authoritative`): (config, namespace, slot_nbytes) -> blocks.
    capacity_blocks: Callable[[FlexKVConfig, Namespace, int], int] | None = None

    @property
    def ours(self) -> bool:
        """A reset of this engine deletes the tier's blocks (it owns them)."""
        return self.role is Role.SPILL
