"""vLLM integration (vLLM 0.23 to 0.33): the `FlexKVConnectorV1` connector.

The published launch line `--kv-transfer-config '{"kv_connector":"FlexKVConnectorV1",
"kv_role":"kv_both"}'` builds it through flexkv-py's vLLM plugin (`plugin.py`), which points
vLLM's built-in name at this class. Without the plugin, add
`"kv_connector_module_path":"flexkv_py.integration.vllm"`: vLLM then imports this module and
takes `FlexKVConnectorV1` from it.

The names below are imported on first use, so that importing the plugin (which vLLM does in
every process) never imports the connector: under a vLLM outside the supported range the
connector's import fails with an error naming the range, and only where one is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexkv_py._lazy import lazy_exports

if TYPE_CHECKING:
    from flexkv_py.integration.vllm.connector import FlexKVConnectorV1
    from flexkv_py.integration.vllm.metadata import FlexKVConnectorMetadata, FlexKVWorkerMetadata
    from flexkv_py.integration.vllm.stats import FlexKVConnectorStats

_HOMES = {
    "FlexKVConnectorV1": "connector",
    "FlexKVConnectorMetadata": "metadata",
    "FlexKVWorkerMetadata": "metadata",
    "FlexKVConnectorStats": "stats",
}

__all__ = [
    "FlexKVConnectorMetadata",
    "FlexKVConnectorStats",
    "FlexKVConnectorV1",
    "FlexKVWorkerMetadata",
]


__getattr__ = lazy_exports(__name__, _HOMES, globals())
