"""What differs between the vLLM releases the connector supports, in one place.

The connector is written against vLLM 0.33's API. Older releases (down to `SUPPORTED_MIN`, what
NVIDIA Dynamo 1.3 pins) lack some of it; every difference is found here by import or attribute,
never by parsing the version string, and the rest of the integration asks this module:

- `CacheHitSource` (vLLM's per-source hit metrics) is 0.33+: older releases get no hit-source
  split (our own per-tier hit counters still report it).
- `KVConnectorTransferResults` / `KVConnectorOutput.failed_recving` (a request-level load
  failure) are 0.31+: older workers report through `get_finished` and block-level errors only.
- `bind_kv_cache_manager` (the scheduler's block tables) is 0.31+: older releases get the tables
  from the scheduler output (`BlockTables`).
- Hybrid models: before 0.31 vLLM has no channel for a failed load of several KV cache groups
  (its invalid-block recovery unpacks one group), so the connector refuses several groups there,
  naming `--disable-hybrid-kv-cache-manager` (sliding-window layers then keep full attention's
  blocks). It still declares `SupportsHMA`: Dynamo's `PdConnector` passes as HMA-capable and
  vLLM asserts that every child is.
- `has_pending_push_work` (the engine keeps stepping while stores are in flight) is 0.26+:
  before it, a lookup that reaches a block being stored asks again until the store reports.
- `to_event_extra_keys` is 0.31+ (before it, extra keys are already the untagged event form);
  `BlockStored` / `BlockRemoved` gained fields over time: events carry only the fields the
  running vLLM's structs have.
- `NONE_HASH`, the root of vLLM's chained block hashes, is drawn from `os.urandom` before 0.31
  whenever `PYTHONHASHSEED` is unset. Since the cache is keyed by vLLM's block hashes, a restarted
  engine or another node would never hit the SSD or the bucket. `pin_none_hash` derives it as
  0.31+ does (a fixed seed for the collision-resistant sha256 family), so every supported
  release keys a text prompt's blocks alike.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# The range tested (README's support table). Older is refused; newer gets one warning.
SUPPORTED_MIN = (0, 23, 0)
TESTED_MAX = (0, 33, 0)
SUPPORTED_RANGE = "vLLM 0.23.0 to 0.33.0"
# vLLM 0.31's NONE_HASH seed when PYTHONHASHSEED is unset (kv_cache_utils.DEFAULT_NONE_HASH_SEED)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_CRYPTO_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})


class UnsupportedVllmError(ConfigError):
    """The installed vLLM is older than the range flexkv-py supports."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def version_tuple(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a vLLM version string such as '0.23.0', '0.31.1+cpu' or
    '0.34.0rc1.dev5' (missing parts count as 0)."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def check_supported(version: str | None = None) -> None:
    """Refuse a vLLM older than the supported range (the error names the range); warn once for
    one newer than the last tested."""
    version = vllm_version() if version is None else version
    found = version_tuple(version)
    # A development build of the last release (0.0.0 or 0.1.dev...) is treated as newest.
    if found < SUPPORTED_MIN and found[:2] != (0, 0) and not version.startswith("0.1.dev"):
        raise UnsupportedVllmError(
            f"flexkv-py's FlexKVConnectorV1 supports {SUPPORTED_RANGE}; the installed vLLM is "
            f"{version}. Install a supported vLLM (Dynamo 1.3 and later pin one), or an older "
            "connector for this vLLM"
        )
    if found > TESTED_MAX:
        _warn_once(
            "newer",
            "flexkv-py: vLLM %s is newer than the last release tested (%s); trying it",
            version,
            ".".join(map(str, TESTED_MAX)),
        )


_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


# ------------------------------------------------------------------ features found by import
def _hit_source() -> Any:
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource


def _transfer_results() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )
    except ImportError:
        return None
    return KVConnectorTransferResults


CacheHitSource: Any = _hit_source()
KVConnectorTransferResults: Any = _transfer_results()


def _has_connector_hook(name: str) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, name)


# The scheduler hands the connector its KV cache manager (block tables, null blocks).
BINDS_KV_CACHE_MANAGER = _has_connector_hook("bind_kv_cache_manager")
# The engine keeps stepping while the connector has stores in flight (0.26+).
ENGINE_STEPS_FOR_STORES = _has_connector_hook("has_pending_push_work")
# A failed load can fail its whole request (needed for several KV cache groups).
REQUEST_LEVEL_LOAD_FAILURES = KVConnectorTransferResults is not None
# Several KV cache groups (the hybrid KV cache manager on): only where both of the above exist.
SEVERAL_KV_GROUPS = BINDS_KV_CACHE_MANAGER and REQUEST_LEVEL_LOAD_FAILURES


def check_kv_groups(num_groups: int) -> None:
    """Refuse several KV cache groups where a failed load of them could not be recomputed."""
    if num_groups > 1 and not SEVERAL_KV_GROUPS:
        raise ConfigError(
            f"FlexKVConnectorV1: vLLM {vllm_version()} planned {num_groups} KV cache groups (a "
            "hybrid model under the hybrid KV cache manager), but it cannot recompute a failed "
            "load of several groups: add --disable-hybrid-kv-cache-manager, or use vLLM >= 0.31"
        )


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block extra keys in the untagged form KV events carry."""
    try:
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys as convert
    except ImportError:  # before 0.31 the keys are untagged already
        keys = list(extra_keys or ())
        return keys or None
    return convert(extra_keys)


def event_fields(struct: type) -> frozenset[str]:
    """The fields a vLLM event struct (msgspec) has in this release."""
    fields = getattr(struct, "__struct_fields__", None)
    if fields is None:
        import dataclasses

        fields = tuple(f.name for f in dataclasses.fields(struct))  # type: ignore[arg-type]
    return frozenset(fields)


def features() -> dict[str, bool]:
    """What this vLLM offers the connector (logged once at start; the README's support table)."""
    return {
        "hit_sources": CacheHitSource is not None,
        "request_level_load_failures": REQUEST_LEVEL_LOAD_FAILURES,
        "kv_cache_manager_binding": BINDS_KV_CACHE_MANAGER,
        "steps_for_pending_stores": ENGINE_STEPS_FOR_STORES,
        "hybrid_kv_cache_manager": SEVERAL_KV_GROUPS,
        "fixed_none_hash_seed": _vllm_fixes_none_hash(),
    }


def log_features_once() -> None:
    if "features" in _warned:
        return
    _warned.add("features")
    missing = [name for name, ok in features().items() if not ok]
    if not missing:
        logger.info("flexkv-py: vLLM %s: every connector feature available", vllm_version())
        return
    logger.info(
        "flexkv-py: vLLM %s lacks %s; the connector does without (README: support table)",
        vllm_version(),
        ", ".join(missing),
    )


def kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    """The physical layout of the registered KV tensors, as it keys the cache. 0.31+ resolves
    one of its KVCacheLayout names. Before it the attention backend picks the layout in the
    worker, where the scheduler cannot see it: the name is "legacy" plus what the operator set
    (VLLM_KV_CACHE_LAYOUT, the attention backend), the same in the scheduler and every worker,
    and apart from any 0.31+ name because such pages' bytes differ."""
    cache_config = vllm_config.cache_config
    resolved = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        cache_config, "kv_cache_layout", None
    )
    if resolved:
        return str(resolved)
    if hasattr(cache_config, "kv_cache_layout"):
        return "LBNHC"  # 0.31+ before the engine core resolved it: vLLM's default
    parts = ["legacy", os.environ.get("VLLM_KV_CACHE_LAYOUT") or "auto"]
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is not None:
        parts.append(str(getattr(backend, "name", backend)))
    return "-".join(parts)


# ------------------------------------------------------------------ NONE_HASH
def _vllm_fixes_none_hash() -> bool:
    from vllm.v1.core import kv_cache_utils

    return hasattr(kv_cache_utils, "resolve_none_hash_seed")


def _fixed_none_hash(hash_fn: Any) -> bytes | None:
    """What 0.31+ derives NONE_HASH from when PYTHONHASHSEED is unset and the hash function is
    collision resistant; None where it stays random (non-cryptographic hashes) or the operator
    set the seed."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return None
    if getattr(hash_fn, "__name__", "") not in _CRYPTO_HASH_ALGOS:
        return None
    return bytes(hash_fn(DEFAULT_NONE_HASH_SEED))


def pin_none_hash(vllm_config: VllmConfig) -> bool:
    """Before 0.31: make this engine core's NONE_HASH what 0.31+ uses, so block hashes (and our
    keys) agree across restarts, nodes and vLLM releases. Called while the scheduler is built,
    which is before the engine core runs `init_none_hash` (its later call is wrapped so the pin
    holds) and before any request is hashed. Returns whether vLLM's hashes are reproducible."""
    from vllm.v1.core import kv_cache_utils

    if _vllm_fixes_none_hash():
        return True
    from vllm.utils.hashing import get_hash_fn_by_name

    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    hash_fn = get_hash_fn_by_name(algo)
    if _fixed_none_hash(hash_fn) is None:
        if os.environ.get("PYTHONHASHSEED") is None:
            _warn_once(
                "none_hash",
                "flexkv-py: prefix_caching_hash_algo=%s is not collision resistant, so vLLM %s "
                "draws a random block-hash root per process: a restarted engine or another node "
                "misses the SSD and the bucket. Set PYTHONHASHSEED to one value on every node "
                "(or use sha256)",
                algo,
                vllm_version(),
            )
            return False
        return True
    _wrap_init_none_hash(kv_cache_utils)
    kv_cache_utils.init_none_hash(hash_fn)  # type: ignore[attr-defined]
    logger.info(
        "flexkv-py: vLLM %s would draw a random block-hash root (PYTHONHASHSEED unset); pinned "
        "to vLLM 0.31's fixed seed so restarts and other nodes hit the SSD and the bucket",
        vllm_version(),
    )
    return True


def _wrap_init_none_hash(kv_cache_utils: Any) -> None:
    original = kv_cache_utils.init_none_hash
    if getattr(original, "_flexkv_pinned", False):
        return

    def init_none_hash(hash_fn: Any) -> None:
        original(hash_fn)
        fixed = _fixed_none_hash(hash_fn)
        if fixed is not None:
            kv_cache_utils.NONE_HASH = kv_cache_utils.BlockHash(fixed)

    init_none_hash._flexkv_pinned = True  # type: ignore[attr-defined]
    kv_cache_utils.init_none_hash = init_none_hash
    # The engine core imported the name; its call after the scheduler is built must pin too.
    import sys

    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None and getattr(core, "init_none_hash", None) is original:
        core.init_none_hash = init_none_hash  # type: ignore[attr-defined]


# ------------------------------------------------------------------ block tables
class BlockTables:
    """Each running request's GPU block ids, from the scheduler output, where vLLM does not
    bind its KV cache manager to the connector (before 0.31). One KV cache group
    (`check_kv_groups`). A resumed request's ids replace its table, as the model
    runner replaces them."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def offer(self, scheduler_output: Any) -> None:
        # A preempted request's blocks go back to the pool: no store may read them by this table.
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._tables.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in resumed:
                self._tables[req_id] = list(ids[0]) if ids else []
            elif ids:
                self._tables.setdefault(req_id, []).extend(ids[0])

    def set(self, req_id: str, tables: Sequence[Sequence[int]]) -> None:
        """The request's blocks as the scheduler just allocated them (update_state_after_alloc)."""
        self._tables[req_id] = list(tables[0]) if tables else []

    def get(self, req_id: str) -> tuple[list[int], ...]:
        return (list(self._tables.get(req_id, ())),)

    def forget(self, req_id: str) -> None:
        self._tables.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._tables)
