"""The `flexkv-py` command line: replay a KV-reuse workload, inspect a cache directory, show the
effective configuration, run the benches."""
