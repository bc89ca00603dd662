"""flexkv-py's stand-in for the original FlexKV's top-level `flexkv` package.

vLLM 0.33's built-in `FlexKVConnectorV1` imports
`flexkv.integration.vllm.vllm_v1_adapter.FlexKVConnectorV1Impl`. With flexkv-py installed, its
`vllm.general_plugins` entry point normally points vLLM's `FlexKVConnectorV1` name at
flexkv-py's own connector, so that import never happens; this package exists so that, when the
plugin is not loaded, the user gets one clear error instead of "FlexKV is not installed".

The marker below tells flexkv-py that these files are its own (the original FlexKV ships a
`flexkv` package too, and pip lets the last install overwrite the other's files).
"""

__flexkv_py__ = True
