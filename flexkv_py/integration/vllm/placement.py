"""Where this engine sits: its id among the engines of its node, how many of them share the
configured sizes, and whether its KV is replicated over TP ranks (MLA). Read from vLLM's configs
and flexkv-py's, alike in the scheduler and every worker (the sizes must agree).

- Engine id: `instance_id` when `instance_num` > 1 (FlexKV's keys: an operator's, e.g. two
  Dynamo workers on one NVMe), else vLLM's `data_parallel_rank` when data parallel, else none
  (one engine: shards keep the plain `tp{r}-pp{p}` name, as before).
- Engines sharing the sizes: `instance_num` when > 1; with `cache_size_scope: node`, vLLM's
  data-parallel ranks on this node (`data_parallel_size_local`); else 1 (sizes per engine).
- Replicated KV: vLLM's `MLAAttentionSpec` (one latent KV per layer, the same on every TP rank)
  at TP > 1: one copy is stored (index/namespace.py `kv_replicated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from flexkv_py.config import FlexKVConfig


@dataclass(frozen=True)
class Placement:
    engine_id: int | None
    node_engines: int
    kv_replicated: bool


def engine_placement(vllm_config: VllmConfig, config: FlexKVConfig, spec: Any) -> Placement:
    """`spec`: the first KV cache group's spec."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    parallel = vllm_config.parallel_config
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    engine_id: int | None = None
    if config.instance_num > 1:
        engine_id = config.instance_id
    elif dp_size > 1:
        engine_id = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    node_engines = 1
    if config.instance_num > 1:
        node_engines = config.instance_num
    elif config.cache_size_scope == "node":
        node_engines = int(getattr(parallel, "data_parallel_size_local", 1) or 1)
    replicated = isinstance(spec, MLAAttentionSpec) and int(parallel.tensor_parallel_size) > 1
    return Placement(engine_id, max(1, node_engines), replicated)
