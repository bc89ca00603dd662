"""vLLM 0.33 integration. Load with

    --kv-transfer-config '{"kv_connector":"FlexKVConnectorV1","kv_role":"kv_both",
                           "kv_connector_module_path":"flexkv_py.integration.vllm"}'

vLLM imports this module and takes `FlexKVConnectorV1` from it (the module path wins over vLLM's
built-in FlexKV connector of the same name).
"""

from __future__ import annotations

from flexkv_py.integration.vllm.connector import FlexKVConnectorV1
from flexkv_py.integration.vllm.metadata import FlexKVConnectorMetadata, FlexKVWorkerMetadata
from flexkv_py.integration.vllm.stats import FlexKVConnectorStats

__all__ = [
    "FlexKVConnectorMetadata",
    "FlexKVConnectorStats",
    "FlexKVConnectorV1",
    "FlexKVWorkerMetadata",
]
