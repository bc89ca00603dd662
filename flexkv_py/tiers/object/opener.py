"""Opening the object tier from the config: the worker's `Tier.OBJECT` and the scheduler's
lookups use the same keys, so both open it here.

Two kinds of failure, two answers:
- the configuration itself is wrong (a URL of no known scheme, a key out of range, an engine
  block hash that is not collision resistant): a `ConfigError` at start, naming the key. Those
  are the operator's to fix, and serving on would share KV unsafely or not at all.
- the bucket cannot be reached or refuses us (wrong secret, missing bucket, server down): a
  loud ERROR and the engine serves without the object tier (`object_unavailable` = 1 in the
  stats), exactly like an SSD that cannot be opened (tiers/ssd/opener.py). A Dynamo fleet shares
  one bucket: if an outage of it made every worker fail its start, the orchestrator would
  restart them in a loop and the fleet would serve nothing, when the only loss is the fleet's
  shared reuse. The message names the endpoint and the cause, never a credential (the native
  tier reads them from ``AWS_*`` and never puts them in an error).
"""

from __future__ import annotations

import logging
from typing import Any

from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import FlexKVError
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.object.hash import require_collision_resistant
from flexkv_py.tiers.object.tier import GcPolicy, ObjectTier

logger = logging.getLogger(__name__)

GIB = 1 << 30


def native_options(config: FlexKVConfig) -> dict[str, Any]:
    """`_native.ObjectTier` keyword arguments from the config (no credential: those come only
    from the AWS_* environment)."""
    kw: dict[str, Any] = {"allow_http": config.object_store_allow_http}
    if config.object_store_endpoint:
        kw["endpoint"] = config.object_store_endpoint
    if config.object_store_region:
        kw["region"] = config.object_store_region
    return kw


def gc_policy(config: FlexKVConfig) -> GcPolicy | None:
    """Background collection when `object_store_gc_ttl_s` is set (None: this worker never
    collects; `flexkv-py gc` or another worker does)."""
    if config.object_store_gc_ttl_s <= 0:
        return None
    budget = config.object_store_gc_budget_gb
    interval = config.object_store_gc_interval_s
    return GcPolicy(
        ttl_s=config.object_store_gc_ttl_s,
        budget_bytes=int(budget * GIB) if budget > 0 else None,
        interval_s=interval,
        lease_s=max(3 * interval, 900.0),
    )


def open_object_tier(
    config: FlexKVConfig, namespace: Namespace, *, collect: bool = True, read_only: bool = False
) -> tuple[ObjectTier | None, str | None]:
    """(tier, None), (None, None) with the object tier off, or (None, why) when the bucket
    cannot be used. `collect`: run the background GC if configured (workers; the scheduler's
    lookup-only tier does not). Raises `ConfigError` for a weak engine hash."""
    url = config.object_store_url
    if url is None:
        return None, None
    require_collision_resistant(namespace.hash_algo, config.object_store_allow_weak_hash)
    try:
        tier = ObjectTier(
            url,
            namespace,
            allow_weak_hash=config.object_store_allow_weak_hash,
            gc=gc_policy(config) if collect and not read_only else None,
            read_only=read_only,
            **native_options(config),
        )
    except FlexKVError as e:
        why = f"{type(e).__name__}: {e}"
        logger.error(
            "object tier UNAVAILABLE for %s: cannot open %s (%s); serving without it, no "
            "object reads or writes until restart",
            namespace.shard_dir_name,
            url,
            why,
        )
        return None, why
    return tier, None
