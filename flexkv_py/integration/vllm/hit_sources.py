"""Where a load's blocks come from (host memory or SSD), for vLLM's hit-source metrics and
our own per-tier hit counters."""

from __future__ import annotations

from typing import Any

from flexkv_py.index.tier_names import Tier
from flexkv_py.integration.vllm.stats import FlexKVConnectorStats


def tokens_by_tier(job: Any, count: int, num_tokens: int, block_size: int) -> dict[Tier, int]:
    """The load's tokens split by the tier each of its first `count` blocks comes from (blocks
    that vanished count as HOST: they are recomputed, and vLLM wants the counts to add up)."""
    tiers = list(getattr(job, "sources", None) or ()) or [Tier.HOST] * count
    out: dict[Tier, int] = {}
    for i, tier in enumerate(tiers[:count]):
        tokens = max(0, min(block_size, num_tokens - i * block_size))
        key = tier or Tier.HOST
        out[key] = out.get(key, 0) + tokens
    return {k: v for k, v in out.items() if v}


def add_tier_hits(stats: FlexKVConnectorStats, job: Any) -> None:
    for tier in getattr(job, "sources", None) or ():
        if tier is not None:
            stats.add(f"hit_blocks_{tier.value}", 1)
