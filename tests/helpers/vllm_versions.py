"""What the test harness needs from vLLM, across the releases the connector supports (0.23-0.33).

The connector's own differences live in `flexkv_py.integration.vllm.compat`; these are the
harness's (vLLM's planning helpers moved to `kv_cache_planning` in 0.33, `allocate_kv_cache` and
`KVConnectorTransferResults` are 0.31+). Found by import, as in compat.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.outputs import KVConnectorOutput

from flexkv_py.integration.vllm import compat

try:  # vLLM 0.33+: the engine core plans the groups, then the configs
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_config_from_groups,
        get_kv_cache_configs,
    )
except ImportError:  # before it, get_kv_cache_configs plans the groups itself
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[no-redef]
        get_kv_cache_config_from_groups,
        get_kv_cache_configs,
    )

    get_global_kv_cache_groups = None


def kv_cache_groups(vllm_config: Any, specs: dict[str, Any]) -> list[Any]:
    """The KV cache groups vLLM forms for one worker's layer specs (the whole model's)."""
    if get_global_kv_cache_groups is None:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

        return list(get_kv_cache_groups(vllm_config, specs))
    return list(get_global_kv_cache_groups(vllm_config, [specs]))


def plan_kv_cache_configs(
    vllm_config: Any, specs: list[dict[str, Any]], memory: list[int]
) -> list[Any]:
    """vLLM's engine-core KV cache planning for every worker's layer specs and memory."""
    if get_global_kv_cache_groups is None:
        return list(get_kv_cache_configs(vllm_config, specs, memory))
    groups = get_global_kv_cache_groups(vllm_config, specs)
    return list(get_kv_cache_configs(vllm_config, specs, memory, groups))


try:  # vLLM 0.31+
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache as _allocate
except ImportError:
    _allocate = None

__all__ = [
    "allocate_kv_cache",
    "get_kv_cache_config_from_groups",
    "kv_cache_groups",
    "kv_connector_output",
    "needs_kv_groups",
    "needs_nixl_on_cpu",
    "plan_kv_cache_configs",
    "transfer_results",
]

VLLM_VERSION = compat.vllm_version()
# Tests of several KV cache groups (the hybrid KV cache manager) need vLLM 0.31+: before it the
# connector refuses them (compat.check_kv_groups); those tests are the support table's ✗ cells.
needs_kv_groups = pytest.mark.skipif(
    not compat.SEVERAL_KV_GROUPS,
    reason=f"vLLM {VLLM_VERSION}: no recompute of a failed load of several KV cache groups",
)


# vLLM 0.23's NixlConnector cannot register the CPU attention backend's KV tensors (it splits
# K and V on dim 0, which is blocks there: "All kv cache tensors must have the same number of
# blocks"); 0.26 can. On a GPU it registers FlashAttention's. Its P/D tests are ✗ cells there.
needs_nixl_on_cpu = pytest.mark.skipif(
    compat.version_tuple(VLLM_VERSION) < (0, 26, 0),
    reason=f"vLLM {VLLM_VERSION}: NixlConnector cannot register CPU attention KV tensors",
)


def allocate_kv_cache(kv_cache_config: Any, layout: str) -> dict[str, torch.Tensor]:
    """The worker's KV tensors on CPU, as `[B, H, N, C]` per layer: vLLM's own allocation
    (0.31+); before it, what the CPU attention backend asks for (get_kv_cache_shape: one
    contiguous `(blocks, kv heads, tokens, 2 * head size)` tensor per layer)."""
    if _allocate is not None:
        return dict(_allocate(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout]))
    out: dict[str, torch.Tensor] = {}
    specs = {
        name: group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    for tensor in kv_cache_config.kv_cache_tensors:
        for name in tensor.shared_by:
            spec = specs[name]
            buf = torch.zeros(tensor.size, dtype=torch.int8)
            blocks = tensor.size // spec.page_size_bytes
            # K|V per token, or MLA's one latent (1 head): what the page holds per head and token.
            per_token = spec.page_size_bytes // (spec.num_kv_heads * spec.block_size)
            width = per_token // torch.empty((), dtype=spec.dtype).element_size()
            out[name] = buf.view(spec.dtype).view(blocks, spec.num_kv_heads, spec.block_size, width)
    return out


def transfer_results(connector: Any, finished: set[str]) -> tuple[set[str], set[str], set[str]]:
    """(finished_sending, finished_recving, failed_recving) of one worker step: through
    `get_transfer_results` where vLLM has it (0.31+), else `get_finished`."""
    if compat.KVConnectorTransferResults is not None:
        r = connector.get_transfer_results(finished)
        return set(r.finished_sending or ()), set(r.finished_recving or ()), set(r.failed_recving)
    sending, recving = connector.get_finished(finished)
    return set(sending or ()), set(recving or ()), set()


_OUTPUT_FIELDS = frozenset(getattr(KVConnectorOutput, "__dataclass_fields__", {}))


def kv_connector_output(**fields: Any) -> KVConnectorOutput:
    """KVConnectorOutput with the fields this vLLM has (failed_recving is 0.31+)."""
    return KVConnectorOutput(**{k: v for k, v in fields.items() if k in _OUTPUT_FIELDS})
