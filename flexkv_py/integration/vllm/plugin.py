"""vLLM general plugin: vLLM's `FlexKVConnectorV1` name builds flexkv-py's connector.

Registered as the `vllm.general_plugins` entry point `flexkv_py`. vLLM 0.33 runs general plugins
once per process (`vllm.plugins.load_general_plugins`) in the API/engine-args process, the engine
core and every worker, before any connector class is looked up (the hybrid-KV check included).
The plugin swaps the factory's lazy loader for that name, so the published launch line
`{"kv_connector":"FlexKVConnectorV1","kv_role":"kv_both"}` gets the full connector, not vLLM's
shim (which passes no `kv_cache_config` and forwards only some hooks).

Idempotent: running it again installs the same loader. It never raises (vLLM does not catch a
failing plugin, and a broken plugin would stop vLLM for every model) and imports nothing of the
connector; a problem, such as the original FlexKV installed beside flexkv-py or a vLLM outside
the supported range (compat.py), is raised when the connector is requested, so the name never
falls back to vLLM's shim, whose error would be about the original FlexKV.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "FlexKVConnectorV1"


def _load_connector_class() -> type:
    from flexkv_py.integration.vllm.coexistence import check_flexkv_owner

    check_flexkv_owner()
    from flexkv_py.integration.vllm.connector import FlexKVConnectorV1

    return FlexKVConnectorV1


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        registry = KVConnectorFactory._registry
        if registry.get(CONNECTOR_NAME) is _load_connector_class:
            return
        registry[CONNECTOR_NAME] = _load_connector_class
    except Exception:  # a broken plugin must not stop vLLM for every model
        logger.warning(
            "flexkv_py plugin: could not register %s with vLLM's KV connector factory",
            CONNECTOR_NAME,
            exc_info=True,
        )
        return
    logger.debug("flexkv_py plugin: %s -> flexkv_py.integration.vllm", CONNECTOR_NAME)
