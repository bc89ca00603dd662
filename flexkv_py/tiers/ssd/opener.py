"""Degraded start: an SSD tier that cannot be opened leaves the rank on the host tier alone.

A cache directory that is full, read-only, holds foreign or damaged files, or is locked by
another live process must not turn into a crash loop of the serving engine: the cache is an
optimisation, the engine serves without it. So `open_ssd_tier` logs one loud ERROR naming the
directories and the cause and returns no tier; the executor then

- reports an empty restart inventory (the scheduler adopts nothing from SSD: with TP/PP the
  other ranks' blocks are orphans and are deleted, never half-served),
- fails every SSD block of a job at once without touching a device (`not_found` on reads,
  failed write-through and spills), so nothing is ever promised from or written to SSD, and
- counts `ssd_unavailable` = 1 in its stats.

Why the worker fails SSD work itself rather than asking the scheduler to turn its SSD tier
off: the scheduler cannot see this failure, and a message through the worker metadata would
arrive steps later (after SSD writes and spills were already planned). Failing fast on the
worker is correct from the first job on and needs no protocol: the scheduler only ever holds an
SSD copy that every rank confirmed (an adopted inventory entry or a successful write), and this
rank confirms none, so no SSD hit is ever promised for it and nothing wrong can be served. The
price is a few cheap failed jobs (spills of evicted blocks, which are then simply dropped, as
without an SSD tier). The connector counts `ssd_unavailable` in its stats and metrics.

Configuration mistakes (ssd_cache_dir missing with ssd_cache_gb set, ...) are still raised by
config validation before this point: those are the operator's to fix, not a device's state.
"""

from __future__ import annotations

import logging

from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import FlexKVError
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.ssd.tier import SsdTier

logger = logging.getLogger(__name__)


def open_ssd_tier(config: FlexKVConfig, namespace: Namespace) -> tuple[SsdTier | None, str | None]:
    """(tier, None), (None, None) with the SSD tier off, or (None, why) when it cannot open."""
    if not config.ssd_enabled:
        return None, None
    try:
        return SsdTier(config, namespace), None
    except (FlexKVError, OSError) as e:
        # StoreLockedError, IoEngineError (OSError), CorruptBlockError, StorageFullError and
        # ConfigError (foreign format, unusable directory) all mean: this rank has no SSD tier.
        why = f"{type(e).__name__}: {e}"
        logger.error(
            "SSD tier UNAVAILABLE for %s: cannot open %s (%s); serving with the host tier "
            "only, no SSD reads or writes until restart",
            namespace.shard_dir_name,
            list(config.ssd_cache_dir),
            why,
        )
        return None, why
