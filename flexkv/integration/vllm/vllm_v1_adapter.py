"""What vLLM's built-in `FlexKVConnectorV1` imports when flexkv-py's plugin did not load.

vLLM's shim builds its implementation as `Impl(vllm_config, role)`: no `kv_cache_config`, and it
forwards only some hooks (no worker metadata, preemption flushes, `reset_cache`, hybrid-model
support, class-level stats). flexkv-py cannot run correctly behind it, so it refuses at start
with the two ways to load flexkv-py's own connector instead.
"""

from __future__ import annotations

import os
from typing import Any

PLUGIN_NAME = "flexkv_py"


def _why_not_loaded(allowed: str | None) -> str:
    """Why vLLM did not run flexkv-py's plugin, read the way vLLM reads VLLM_PLUGINS (a comma
    list, names not stripped)."""
    if allowed is None:
        return "vLLM did not run it in this process (is flexkv-py installed in this environment?)"
    names = allowed.split(",")
    if PLUGIN_NAME in names:
        return (
            f"VLLM_PLUGINS={allowed!r} allows it, but this process never ran vLLM's "
            "load_general_plugins()"
        )
    if PLUGIN_NAME in (n.strip() for n in names):
        return (
            f"VLLM_PLUGINS={allowed!r} names it with spaces around it, which vLLM does not strip"
        )
    return f"VLLM_PLUGINS={allowed!r} does not allow it"


def _plugin_blocked_message() -> str:
    why = _why_not_loaded(os.environ.get("VLLM_PLUGINS"))
    return (
        "flexkv-py: vLLM built its own FlexKVConnectorV1 shim because flexkv-py's vLLM plugin "
        f"'flexkv_py' was not loaded ({why}). flexkv-py cannot run behind that shim. Either "
        "allow the plugin (add flexkv_py to VLLM_PLUGINS, or unset VLLM_PLUGINS), or load "
        "flexkv-py's connector directly by adding "
        '"kv_connector_module_path":"flexkv_py.integration.vllm" to --kv-transfer-config.'
    )


class FlexKVConnectorV1Impl:
    """Refuses to start: see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from flexkv_py.errors import ConfigError
        from flexkv_py.integration.vllm.coexistence import check_flexkv_owner

        check_flexkv_owner()  # the original FlexKV's files in the way: say that first
        raise ConfigError(_plugin_blocked_message())
