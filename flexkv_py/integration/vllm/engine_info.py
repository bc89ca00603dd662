"""Facts about the engine the connector serves, read once from vLLM's configs.

Both halves derive the namespace from the same `VllmConfig` + `KVCacheConfig`, so the scheduler
(which never sees a KV tensor) and every worker agree on keys and page size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.integration.vllm import compat
from flexkv_py.integration.vllm.events import events_enabled
from flexkv_py.integration.vllm.identity import kv_cache_format, model_identity
from flexkv_py.integration.vllm.pipeline_stages import check_even_stages
from flexkv_py.integration.vllm.placement import engine_placement

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class UnsupportedKVCacheError(ConfigError):
    """The engine's KV cache shape is one this connector cannot store (named in the message)."""


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV cache group: its layers share a block table and a kind of attention."""

    group_id: int
    kind: str  # "full" | "sliding" | "mamba"
    block_size: int
    window: int  # sliding window in tokens (0 for full attention)
    layer_names: tuple[str, ...]
    page_bytes: int  # one block of this group: all its layers of this rank's shard
    namespace: Namespace  # rank-less, keys this group's blocks
    # What vLLM's own KV events say of the group (kv_cache_spec_kind, sliding window).
    event_kind: str | None = None
    event_window: int | None = None
    # Hash blocks (entries of Request.block_hashes) per block of this group: 1 unless vLLM
    # gave the group a larger block size than the hash block size.
    scale: int = 1

    @property
    def window_blocks(self) -> int:
        """Blocks before a boundary that a request resuming there reads (vLLM's
        SlidingWindowManager: the last W-1 tokens); a Mamba group's one state block (the
        one ending there); 0 for full attention (all of them)."""
        if self.kind == "mamba":
            return 1
        return -(-(self.window - 1) // self.block_size) if self.kind == "sliding" else 0

    @property
    def restores_state(self) -> bool:
        """A state-space group: one block holds the state after a prefix (vLLM's Mamba
        "align" mode); only boundary states vLLM hands off are stored, keyed by the block
        hash ending there."""
        return self.kind == "mamba"


@dataclass(frozen=True)
class EngineInfo:
    namespace: Namespace  # rank-less; workers use namespace.for_rank(...); group 0's
    block_size: int  # tokens per entry of Request.block_hashes (every group's, unless scaled)
    page_bytes: int  # one block, all layers of this rank's shard (of its PP stage's layers)
    tp_size: int
    pp_size: int
    can_load: bool  # kv_role consumer or both
    can_store: bool  # kv_role producer or both
    # DYNAMO_USE_FLEXKV=1 or vLLM's KV events on: tier events become vLLM KV events.
    publish_kv_events: bool = False
    # vLLM's KV cache groups (one unless the hybrid allocator runs a hybrid model).
    groups: tuple[GroupInfo, ...] = ()

    @property
    def num_workers(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def hit_align_blocks(self) -> int:
        """Hash blocks a hit's end is a multiple of: vLLM's scheduler block size (the LCM of
        the groups' block sizes) over the hash block size."""
        return math.lcm(*(g.scale for g in self.groups)) if self.groups else 1


def _group_kind(gid: int, spec: Any) -> tuple[str, int]:
    """(kind, window) of a group's spec; UnsupportedKVCacheError names what cannot be stored."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, FullAttentionSpec):
        return "full", 0
    if type(spec) is SlidingWindowSpec:
        return "sliding", int(spec.sliding_window)
    if isinstance(spec, MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", None)
        if mode != "align":
            raise UnsupportedKVCacheError(
                f"kv_cache_groups[{gid}]: a state-space group ({type(spec).__name__}, "
                f"mamba_type={getattr(spec, 'mamba_type', '?')}) with mamba_cache_mode={mode!r}: "
                "FlexKVConnectorV1 stores the boundary states of mode 'align' only (vLLM sets it "
                "with --enable-prefix-caching)"
            )
        if int(getattr(spec, "num_speculative_blocks", 0) or 0) > 0:
            raise UnsupportedKVCacheError(
                f"kv_cache_groups[{gid}]: a state-space group with speculative state blocks "
                f"(num_speculative_blocks={spec.num_speculative_blocks}) is not supported"
            )
        return "mamba", 0
    raise UnsupportedKVCacheError(
        f"kv_cache_groups[{gid}]: {type(spec).__name__} is not supported (full-attention, "
        "sliding-window and Mamba 'align' groups only)"
    )


def hash_block_size(kv_cache_config: KVCacheConfig) -> int:
    """Tokens per entry of `Request.block_hashes`: what vLLM's engine core resolved
    (`resolve_kv_cache_block_sizes`: the GCD of the groups' block sizes), or that GCD."""
    sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups]
    resolved = getattr(kv_cache_config, "hash_block_size", None)
    return int(resolved) if resolved else math.gcd(*sizes)


def _check_block_sizes(rows: list[Any], hash_bs: int) -> None:
    """Groups may differ in block size (vLLM raises a group's to even out page sizes, e.g. a
    sliding-window group with smaller heads) if each is a multiple of the hash block size;
    a state group's must equal it (a larger one is vLLM's sub-block partial hits)."""
    for gid, kind, _, _, spec, _ in rows:
        bs = int(spec.block_size)
        if bs % hash_bs:
            raise UnsupportedKVCacheError(
                f"kv_cache_groups[{gid}]: block size {bs} is not a multiple of the hash block "
                f"size {hash_bs}"
            )
        if kind == "mamba" and bs != hash_bs:
            raise UnsupportedKVCacheError(
                f"kv_cache_groups[{gid}]: a state-space group of block size {bs} hashed every "
                f"{hash_bs} tokens (sub-block partial hits, prefix_match_unit) is not supported; "
                "its block size must equal the hash block size"
            )


def read_groups(kv_cache_config: KVCacheConfig, base: Namespace) -> tuple[GroupInfo, ...]:
    """Every KV cache group, each with its own namespace derived from `base` (each namespace
    owns the keys of all groups: they share the host pool and the SSD shard). A group keys its
    blocks at its own block size: block i's key holds the hash ending at its last token."""
    rows = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind, window = _group_kind(gid, spec)
        layers = tuple(group.layer_names)
        rows.append((gid, kind, window, int(spec.page_size_bytes) * len(layers), spec, layers))
    if not rows:
        raise UnsupportedKVCacheError("kv_cache_groups: the engine has no KV cache group")
    hash_bs = base.block_size
    _check_block_sizes(rows, hash_bs)
    sizes = tuple(int(r[4].block_size) for r in rows)
    if len(rows) > 1:
        base = replace(
            base,
            groups=tuple((g, k, w, p) for g, k, w, p, _, _ in rows),
            group_block_sizes=sizes if len(set(sizes)) > 1 else (),
        )
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return tuple(
        GroupInfo(
            gid,
            kind,
            int(spec.block_size),
            window,
            layers,
            page,
            base.for_group(
                gid,
                kind,
                window,
                page_bytes=page,
                block_size=None if int(spec.block_size) == hash_bs else int(spec.block_size),
            ),
            get_kv_cache_spec_kind(spec).value,
            get_kv_cache_spec_sliding_window(spec),
            scale=int(spec.block_size) // hash_bs,
        )
        for gid, kind, window, page, spec, layers in rows
    )


def read_engine_info(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: FlexKVConfig | None = None
) -> EngineInfo:
    """`config`: flexkv-py's configuration (model_identity / model_epoch); None reads it."""
    if config is None:
        config = read_flexkv_config(vllm_config)
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    if not kv_cache_config.kv_cache_groups:
        raise UnsupportedKVCacheError("kv_cache_groups: the engine has no KV cache group")
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    _group_kind(0, spec)  # a clear error before anything reads the spec's fields
    check_even_stages(vllm_config)  # PP: the page below is this stage's, the same on every stage
    cache_config = vllm_config.cache_config
    layout = compat.kv_cache_layout(vllm_config, kv_cache_config)
    parallel = vllm_config.parallel_config
    model_config = vllm_config.model_config
    # An operator's model_identity replaces everything about this copy, its path included.
    override = config.model_identity
    place = engine_placement(vllm_config, config, spec)
    base = Namespace(
        model=override or str(model_config.model),
        revision=None if override else model_config.revision,
        kv_dtype=kv_cache_format(cache_config, getattr(spec, "dtype", None)),
        kv_layout=str(layout),
        block_size=hash_block_size(kv_cache_config),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(cache_config.prefix_caching_hash_algo),
        model_identity=model_identity(
            model_config, override=config.model_identity, epoch=config.model_epoch
        ),
        engine_id=place.engine_id,
        node_engines=place.node_engines,
        kv_replicated=place.kv_replicated,
    )
    groups = read_groups(kv_cache_config, base)
    # One host slot holds one block of any group (HMA aliases every group onto the same
    # per-slot tensors, so pages are equal; the largest one otherwise).
    page_bytes = max(g.page_bytes for g in groups)
    return EngineInfo(
        namespace=groups[0].namespace,
        block_size=base.block_size,
        page_bytes=page_bytes,
        tp_size=base.tp_size,
        pp_size=base.pp_size,
        can_load=bool(ktc.is_kv_consumer),
        can_store=bool(ktc.is_kv_producer),
        publish_kv_events=events_enabled(vllm_config.kv_events_config),
        groups=groups,
    )


def read_flexkv_config(vllm_config: VllmConfig) -> FlexKVConfig:
    """FlexKV env vars / FLEXKV_CONFIG_PATH, overridden by kv_connector_extra_config."""
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    overrides = dict(ktc.kv_connector_extra_config or {})
    return load_config(overrides)


def worker_rank(vllm_config: VllmConfig) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker process."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_rank(), ps.get_pp_group().rank_in_group
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    return parallel.rank % tp, parallel.rank // tp
