"""Facts about the engine the connector serves, read once from vLLM's configs.

Both halves derive the namespace from the same `VllmConfig` + `KVCacheConfig`, so the scheduler
(which never sees a KV tensor) and every worker agree on keys and page size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.integration.vllm.events import events_enabled
from flexkv_py.integration.vllm.identity import kv_cache_format, model_identity
from flexkv_py.integration.vllm.pipeline_stages import check_even_stages

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class UnsupportedKVCacheError(ConfigError):
    """The engine's KV cache shape is one this connector cannot store (named in the message)."""


@dataclass(frozen=True)
class EngineInfo:
    namespace: Namespace  # rank-less; workers use namespace.for_rank(...)
    block_size: int
    page_bytes: int  # one block, all layers of this rank's shard (of its PP stage's layers)
    tp_size: int
    pp_size: int
    can_load: bool  # kv_role consumer or both
    can_store: bool  # kv_role producer or both
    # DYNAMO_USE_FLEXKV=1 or vLLM's KV events on: tier events become vLLM KV events.
    publish_kv_events: bool = False

    @property
    def num_workers(self) -> int:
        return self.tp_size * self.pp_size


def _single_full_attention_group(kv_cache_config: KVCacheConfig) -> tuple[Any, list[str]]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedKVCacheError(
            f"kv_cache_groups: FlexKVConnectorV1 needs exactly one KV cache group (hybrid "
            f"allocator off); got {len(groups)}: "
            f"{[type(g.kv_cache_spec).__name__ for g in groups]}"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec):
        raise UnsupportedKVCacheError(
            f"kv_cache_spec: {type(spec).__name__} is not supported (full attention only; "
            "sliding-window and state-space caches cannot be restored from a prefix)"
        )
    return spec, list(groups[0].layer_names)


def read_engine_info(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: FlexKVConfig | None = None
) -> EngineInfo:
    """`config`: flexkv-py's configuration (model_identity / model_epoch); None reads it."""
    if config is None:
        config = read_flexkv_config(vllm_config)
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    spec, layer_names = _single_full_attention_group(kv_cache_config)
    check_even_stages(vllm_config)  # PP: the page below is this stage's, the same on every stage
    cache_config = vllm_config.cache_config
    layout = kv_cache_config.kv_cache_layout or cache_config.kv_cache_layout or "LBNHC"
    parallel = vllm_config.parallel_config
    model_config = vllm_config.model_config
    page_bytes = int(spec.page_size_bytes) * len(layer_names)
    # An operator's model_identity replaces everything about this copy, its path included.
    override = config.model_identity
    namespace = Namespace(
        model=override or str(model_config.model),
        revision=None if override else model_config.revision,
        kv_dtype=kv_cache_format(cache_config, spec.dtype),
        kv_layout=str(layout),
        block_size=int(spec.block_size),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(cache_config.prefix_caching_hash_algo),
        page_bytes=page_bytes,
        model_identity=model_identity(
            model_config, override=config.model_identity, epoch=config.model_epoch
        ),
    )
    return EngineInfo(
        namespace=namespace,
        block_size=int(spec.block_size),
        page_bytes=page_bytes,
        tp_size=namespace.tp_size,
        pp_size=namespace.pp_size,
        can_load=bool(ktc.is_kv_consumer),
        can_store=bool(ktc.is_kv_producer),
        publish_kv_events=events_enabled(vllm_config.kv_events_config),
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
