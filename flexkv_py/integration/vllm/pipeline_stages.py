"""Pipeline parallel: why every stage must hold as many KV layers as every other.

Under PP each stage's workers register only their own layers' KV caches, and vLLM gives each
worker its stage's KVCacheConfig (the whole model's groups projected onto the stage's layers,
`get_kv_cache_configs`); the scheduler gets a copy of the first worker's, i.e. stage 0's layers
(`generate_scheduler_kv_cache_config`). num_blocks is the same everywhere, but a page (one block
of all the layers a worker holds) is per-layer page x the stage's layer count. The scheduler plans
host slots (`host_slots_for`) and names keys (the namespace digests the page size) from stage 0's
page, and each worker sizes its pool and checks its keys from its own: they agree only when every
stage holds the same number of layers. With an uneven split (e.g. 32 layers over PP=3, split
11/11/10 by vLLM, or a VLLM_PP_LAYER_PARTITION) a stage with larger pages would get fewer host
slots than the scheduler hands out and would never recognise its SSD blocks after a restart, so
such an engine is refused at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexkv_py.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class UnevenPipelineStagesError(ConfigError):
    """PP stages hold different numbers of layers (so their KV pages differ)."""


def stage_layer_counts(vllm_config: VllmConfig) -> list[int]:
    """Layers of each PP stage, as vLLM's model loader splits them (get_pp_indices)."""
    from vllm.distributed.utils import get_pp_indices

    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    total = int(vllm_config.model_config.get_total_num_hidden_layers())
    return [end - start for start, end in (get_pp_indices(total, p, pp) for p in range(pp))]


def check_even_stages(vllm_config: VllmConfig) -> None:
    """Refuse a PP split whose stages' pages differ (see the module docstring)."""
    if int(vllm_config.parallel_config.pipeline_parallel_size) <= 1:
        return
    counts = stage_layer_counts(vllm_config)
    if len(set(counts)) > 1:
        raise UnevenPipelineStagesError(
            f"pipeline_parallel_size: stages hold {counts} layers; FlexKVConnectorV1 needs the "
            "same number of layers on every stage (their KV pages must be equal): pick a PP size "
            "that divides the layer count or set VLLM_PP_LAYER_PARTITION to equal parts"
        )
