"""vLLM 0.33 integration: the `FlexKVConnectorV1` connector.

The published launch line `--kv-transfer-config '{"kv_connector":"FlexKVConnectorV1",
"kv_role":"kv_both"}'` builds it through flexkv-py's vLLM plugin (`plugin.py`), which points
vLLM's built-in name at this class. Without the plugin, add
`"kv_connector_module_path":"flexkv_py.integration.vllm"`: vLLM then imports this module and
takes `FlexKVConnectorV1` from it.
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
