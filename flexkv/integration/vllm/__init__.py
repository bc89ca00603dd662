"""flexkv-py's compatibility path for vLLM's built-in FlexKV connector (see `flexkv`)."""
